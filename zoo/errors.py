"""The one exception zoo raises for bad input: its message says what was expected, what came, what to do."""


class ZooError(ValueError):
    """Bad input to zoo (unknown name, wrong shape, corrupt or unsupported checkpoint)."""
