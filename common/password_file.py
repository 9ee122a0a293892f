"""A password read from a file, so it sits in no config, URL or command line (Redis's
``remote_password_file``, etcd's ``password_file=`` in ``--discovery``)."""

from __future__ import annotations

import os
import stat

from kvferry.common.errors import ConfigurationError
from kvferry.common.log import get_logger

logger = get_logger(__name__)

MAX_PASSWORD_CHARS = 4096


class PasswordFileError(ConfigurationError, ValueError):
    """A password file that cannot be used; the message names the setting and the fix."""


def read_password_file(path: str, source: str) -> str:
    """The file's first line; a file others may read is used, with a warning naming chmod."""
    try:
        with open(path, encoding="utf-8") as f:
            st = os.fstat(f.fileno())  # the mode of the file read, not of whatever the path named before
            text = f.read(MAX_PASSWORD_CHARS + 1)
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise PasswordFileError(f"{source}: cannot read the password file {path!r} ({why}): fix the path or its "
                                "permissions") from None
    password = text.splitlines()[0] if text.strip() else ""
    if not password or len(text) > MAX_PASSWORD_CHARS:
        raise PasswordFileError(f"{source}: the password file {path!r} is empty or longer than {MAX_PASSWORD_CHARS} "
                                "characters: put the password alone on its first line")
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("%s: password file %s can be read by other users: chmod 600 %s", source, path, path)
    return password
