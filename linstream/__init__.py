"""The `linstream` command line: the server's `serve` and the client commands as one program (cli.py)."""
