"""The ``fedfs`` command line. Subcommands live in their own modules and load lazily."""
