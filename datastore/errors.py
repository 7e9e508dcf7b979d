"""Exceptions with messages meant for the person who typed the command."""


class DatastoreError(Exception):
    """A datastore cannot be built, opened or changed: missing, truncated, wrong version, bad option."""


class CorpusError(DatastoreError):
    """The corpus is unusable; the message names the file and, where there is one, the line."""


class EnrollmentConflict(DatastoreError):
    """An enrollment gives an utterance id the speaker already has, with other tokens (409 over HTTP)."""


class DamagedStoreError(DatastoreError):
    """A store's files are inconsistent though the catalog accepted them (corrupted on disk): the store is
    refused; others stay usable. `echospec info --verify` names the damaged file."""


def one_line(error: BaseException) -> str:
    """An exception's message as one line (numpy's header errors span several), at most 200 characters."""
    message = error.args[0] if len(error.args) > 1 and isinstance(error.args[0], str) else error  # TokenError
    text = " ".join(str(message).split()) or type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."
