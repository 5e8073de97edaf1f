"""Client subcommands of `linstream` (registered on clients.cli.app)."""
