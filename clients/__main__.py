"""`python -m clients` == `linstream`."""
from .cli import main

main()
