"""A reply's text as its tokens arrive: bytes decoded once a character is whole (a multibyte
character can span two tokens), stop strings found across token boundaries, and the text that
could still begin a stop string held back until it cannot."""

from __future__ import annotations

import codecs


class ReplyText:
    def __init__(self, stop: list[str]):
        self.stop = [s for s in stop if s]
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""
        self.stopped = False

    def add(self, piece: bytes) -> str:
        """A token's bytes; returns the text that can be sent now ('' while held). After a stop
        string is found, `stopped` is set and nothing more is returned."""
        if self.stopped:
            return ""
        self._held += self._utf8.decode(piece)
        for s in self.stop:
            at = self._held.find(s)
            if at >= 0:
                out, self._held, self.stopped = self._held[:at], "", True
                return out
        keep = max((n for s in self.stop for n in range(min(len(s) - 1, len(self._held)), 0, -1)
                    if self._held.endswith(s[:n])), default=0)
        out = self._held[: len(self._held) - keep]
        self._held = self._held[len(out):]
        return out

    def flush(self) -> str:
        """The end of the reply: what was held back, and any incomplete character as U+FFFD."""
        out = self._held + self._utf8.decode(b"", final=True)
        self._held = ""
        return "" if self.stopped else out

