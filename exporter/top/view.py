"""What the screen shows between polls: the last status document read, and the last failure since."""

from __future__ import annotations

from dataclasses import dataclass

from exporter.api.v1 import StatusDocument
from exporter.top.fetch import Fetched, FetchFailed, FetchResult, Target


@dataclass
class View:
    """The sidecar being watched, its last document (kept while it cannot be read) and why not."""

    target: Target
    interval: float
    document: StatusDocument | None = None
    document_at: float | None = None  # wall-clock time the document was read
    failure: FetchFailed | None = None  # the latest failed poll, until one succeeds
    failures_in_row: int = 0
    polls: int = 0

    def update(self, result: FetchResult) -> None:
        """Take one poll's result: a document replaces the last one, a failure is shown over it."""
        self.polls += 1
        if isinstance(result, Fetched):  # decoded and of this api_version (fetch.received)
            self.document, self.document_at = result.document, result.at
            self.failure, self.failures_in_row = None, 0
        else:
            self._failed(result)

    def _failed(self, failure: FetchFailed) -> None:
        self.failure = failure
        self.failures_in_row += 1

    @property
    def ok(self) -> bool:
        """The last poll brought a document this top can show."""
        return self.failure is None and self.document is not None
