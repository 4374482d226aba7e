"""Errors that name the file and the key they are about."""


class LycorisError(ValueError):
    """A LyCORIS file, or one module of it, that cannot be applied.

    The message always says which file and which key, so a user reading the ComfyUI error dialog knows what to fix
    without reading logs.
    """

    def __init__(self, reason: str, *, file: str | None = None, key: str | None = None):
        self.reason = reason
        self.file = file
        self.key = key
        super().__init__(self._render())

    def _render(self) -> str:
        where = ": ".join(part for part in (self.file, self.key) if part)
        return f"{where}: {self.reason}" if where else self.reason

    def located(self, *, file: str | None = None, key: str | None = None) -> "LycorisError":
        """The same error with the file/key filled in where they were unknown when it was raised."""
        return LycorisError(self.reason, file=self.file or file, key=self.key or key)
