"""The `kvlab` command line: the entry point, start-up guard, subcommand dispatch and the small commands."""
