"""`python -m linstream.clients`: the client commands of `linstream` (`python -m linstream` adds `serve`)."""
from .cli import main

main()
