"""User-facing errors: each one prints as a single line naming what is at fault."""


class SlimError(Exception):
    """An error the user can fix; the CLI prints it as one line and exits with `exit_code`."""

    exit_code = 1


class ConfigError(SlimError):
    """Bad configuration: unknown key, wrong type, missing file, impossible layout."""

    exit_code = 2
