"""The one exception type users see: its message is a single sentence that says what to fix."""


class AccudiffError(Exception):
    """A problem with the user's input or environment (exit code 2 on the command line)."""
