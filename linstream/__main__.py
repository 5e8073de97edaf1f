"""`python -m linstream` == `linstream`."""
from .cli import main

main()
