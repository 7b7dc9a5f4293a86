"""The one exception type users see: a single line that names the problem and the fix."""


class GorgonError(Exception):
    """Bad input or state that the user can fix; the CLI prints it without a traceback."""
