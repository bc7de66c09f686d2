"""The API keys: ``[server] api_key`` (one unnamed key, principal ``default``) and the named keys
of ``[server] api_keys_file``, a TOML file of ``[[keys]]`` tables (``name``, ``key_sha256``, and
optionally ``max_running``, ``max_waiting``, ``weight``). Keys are kept as SHA-256 hashes; a key
is checked against every entry with ``hmac.compare_digest`` and no early exit, so a wrong key and
a right one take the same time. ``reload`` (on SIGHUP) swaps in the file's new set at once:
requests in flight keep running, a removed key is refused from the next request on."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import tomllib
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("neuron.server")

NAME = re.compile(r"^[A-Za-z0-9._@-]{1,64}$")
HEX = re.compile(r"^[0-9a-f]{64}$")


class KeysFileError(ValueError):
    pass


@dataclass(frozen=True)
class Principal:
    """Whose request it is, and what fair share gives it."""

    name: str
    max_running: int = 0  # 0: no cap
    max_waiting: int = 0
    weight: float = 1.0
    gateway: bool = False  # a gateway's key: its requests may name their account (principal_header)


@dataclass(frozen=True)
class Entry:
    digest: bytes
    principal: Principal


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def read_keys_file(path: str, max_running: int = 0, max_waiting: int = 0) -> list[Entry]:
    """The entries of a keys file; KeysFileError says what is wrong with it."""
    try:
        mode = Path(path).stat().st_mode
        if mode & 0o077:
            raise KeysFileError(f"the keys file {path} is readable or writable by others (mode {mode & 0o777:o}): "
                                f"chmod 600 it")
        data = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise KeysFileError(f"cannot read the keys file {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise KeysFileError(f"the keys file {path} is not valid TOML: {exc}") from None
    if set(data) - {"keys"} or not isinstance(data.get("keys", []), list):
        raise KeysFileError(f"the keys file {path} holds only [[keys]] tables")
    entries, names = [], set()
    for i, raw in enumerate(data.get("keys", [])):
        where = f"{path}: keys[{i}]"
        if not isinstance(raw, dict) or set(raw) - {"name", "key_sha256", "max_running", "max_waiting", "weight",
                                                    "gateway"}:
            raise KeysFileError(f"{where} takes name, key_sha256, max_running, max_waiting, weight and gateway")
        if not isinstance(raw.get("gateway", False), bool):
            raise KeysFileError(f"{where}: gateway must be true or false")
        name, hexdigest = raw.get("name"), raw.get("key_sha256")
        if not isinstance(name, str) or not NAME.match(name) or name in names:
            raise KeysFileError(f"{where}: name must be unique, 1-64 of A-Z a-z 0-9 . _ @ -")
        if not isinstance(hexdigest, str) or not HEX.match(hexdigest.lower()):
            raise KeysFileError(f"{where}: key_sha256 must be the key's SHA-256 in 64 hex digits")
        running, waiting = raw.get("max_running", max_running), raw.get("max_waiting", max_waiting)
        weight = raw.get("weight", 1)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (running, waiting)):
            raise KeysFileError(f"{where}: max_running and max_waiting must be whole numbers, 0 for no cap")
        check_weight(weight, where)
        names.add(name)
        entries.append(Entry(bytes.fromhex(hexdigest), Principal(name, running, waiting, float(weight),
                                                                 raw.get("gateway", False))))
    return entries


def check_weight(weight: object, where: str) -> None:
    if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not 0 < weight <= 1000:
        raise KeysFileError(f"{where}: weight must be a number in (0, 1000]")


class KeyRing:
    def __init__(self, api_key: str = "", keys_file: str = "", max_running: int = 0, max_waiting: int = 0) -> None:
        self.keys_file = keys_file
        self.caps = (max_running, max_waiting)
        self.fixed = [Entry(digest(api_key), Principal("default", max_running, max_waiting))] if api_key else []
        self.entries = self.fixed + (read_keys_file(keys_file, *self.caps) if keys_file else [])

    @property
    def open(self) -> bool:
        """No key configured: every request is served, as principal ``anonymous``."""
        return not self.entries

    def check(self, given: str) -> Principal | None:
        """The principal of ``given``, or None: not a key."""
        want = digest(given)
        found = None
        for entry in self.entries:  # every entry, always: the time says nothing of which matched
            if hmac.compare_digest(want, entry.digest) and found is None:
                found = entry.principal
        return found

    def reload(self) -> bool:
        """Re-read the keys file; a file that does not read keeps the keys as they were."""
        if not self.keys_file:
            return False
        try:
            entries = read_keys_file(self.keys_file, *self.caps)
        except KeysFileError as exc:
            log.error("keys file not reloaded, the keys stay as they were: %s", exc)
            return False
        self.entries = self.fixed + entries
        log.info("keys file reloaded: %d named keys", len(entries))
        return True


def add_key(path: str, name: str, max_running: int | None = None, max_waiting: int | None = None,
            weight: float | None = None, gateway: bool = False) -> str:
    """A new key for ``name``, appended to the keys file (made if absent, private to its owner) as
    its hash; the key itself is returned once and kept nowhere. Everything is checked before the
    file is touched, and the new file replaces the old in one rename: a bad entry is never written."""
    file = Path(path)
    existing = read_keys_file(path) if file.exists() else []
    if any(e.principal.name == name for e in existing):
        raise KeysFileError(f"{path} already has a key named {name!r}")
    if not NAME.match(name):
        raise KeysFileError("a key's name is 1-64 of A-Z a-z 0-9 . _ @ -")
    for cap, value in (("max_running", max_running), ("max_waiting", max_waiting)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise KeysFileError(f"{cap} must be a whole number, 0 for no cap")
    if weight is not None:
        check_weight(weight, "weight")
    key = "nk-" + secrets.token_urlsafe(32)
    lines = ["", "[[keys]]", f'name = "{name}"', f'key_sha256 = "{digest(key).hex()}"']
    for field, value in (("max_running", max_running), ("max_waiting", max_waiting), ("weight", weight)):
        if value is not None:
            lines.append(f"{field} = {value}")
    if gateway:
        lines.append("gateway = true")
    text = (file.read_text() if file.exists() else "# neuron API keys (neuron keys add NAME)\n") + "\n".join(lines) + "\n"
    tmp = file.with_name(f".{file.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        read_keys_file(str(tmp))  # what would be written reads back
        os.replace(tmp, file)
    finally:
        tmp.unlink(missing_ok=True)
    return key
