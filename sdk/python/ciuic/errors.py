"""ciuic's exceptions: one subclass of :class:`Error` per status code.

Every error from the SDK or the daemon raises the subclass of its code, e.g.
``InvalidArgumentError`` for a mismatched submission or ``UnavailableError``
when the daemon cannot be reached. ``err.code`` is a :class:`StatusCode`
(an ``IntEnum``: ``err.code.name == "INVALID_ARGUMENT"``, ``int(err.code) ==
3``) and ``err.message`` the daemon's message.
"""

import enum


class StatusCode(enum.IntEnum):
    """The codes of absl::Status / gRPC, as ciuic::StatusCode."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class Error(Exception):
    """Base of every ciuic error; ``code`` (StatusCode) and ``message``."""

    code = StatusCode.UNKNOWN

    def __init__(self, message="", code=None):
        if code is not None:
            self.code = StatusCode(code)
        self.message = message
        super().__init__(message)

    def __str__(self):
        return f"{self.code.name}: {self.message}"

    def __reduce__(self):  # picklable (multiprocessing) with its code
        return (_make_error, (int(self.code), self.message))


Error.__module__ = "ciuic"


def _class_name(code):
    return "".join(part.capitalize() for part in code.name.split("_")) + "Error"


_BY_CODE = {}
for _code in StatusCode:
    if _code == StatusCode.OK:
        continue
    _cls = type(_class_name(_code), (Error,), {"code": _code, "__module__": "ciuic"})
    _cls.__doc__ = f"Status code {_code.name} ({int(_code)})."
    globals()[_cls.__name__] = _cls
    _BY_CODE[int(_code)] = _cls
del _code, _cls


def error_class(code):
    """The Error subclass of a StatusCode (or int)."""
    return _BY_CODE.get(int(code), Error)


def _make_error(code, message):
    """Builds the exception of a status; registered with the extension."""
    cls = _BY_CODE.get(int(code))
    if cls is None:
        return Error(message, code=StatusCode.UNKNOWN if code not in StatusCode._value2member_map_
                     else code)
    return cls(message)


__all__ = ["Error", "StatusCode", "error_class"] + [c.__name__ for c in _BY_CODE.values()]
