"""Command-line entry points behind the ``vlfit`` subcommands."""
