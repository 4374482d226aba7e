"""Errors that name the file and the key they are about."""

# A file controls its key names and header text: an error quoting them stays readable (and a 1 MB key name does not
# end up whole in the UI, the log and every response that carries the error).
MAX_NAME = 200
MAX_REASON = 1000


def encodable(text: str) -> str:
    """`text`, with any lone UTF-16 surrogate (JSON's "\\ud800" is a valid escape) written as its escape: names and
    metadata from a file end up in UI strings, logs and responses, which must encode as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def clipped(text: str, limit: int) -> str:
    """`text`, cut to `limit` characters with the number left out said at the end, and `encodable`."""
    return encodable(text if len(text) <= limit else f"{text[:limit]}… ({len(text) - limit} more characters)")


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
        where = ": ".join(clipped(part, MAX_NAME) for part in (self.file, self.key) if part)
        reason = clipped(self.reason, MAX_REASON)
        return f"{where}: {reason}" if where else reason

    def located(self, *, file: str | None = None, key: str | None = None) -> "LycorisError":
        """The same error with the file/key filled in where they were unknown when it was raised."""
        return LycorisError(self.reason, file=self.file or file, key=self.key or key)
