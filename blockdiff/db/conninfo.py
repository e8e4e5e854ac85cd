"""libpq connection strings, read the way libpq reads them: what may be
shown or stored of one (:func:`public_url`, the one scrubber every message,
configuration file and output goes through), whether libpq and blockdiff
can use one (:func:`check_url`), the secrets it carries
(:func:`secrets_of`) and the passfile lines that give its password back
(:func:`passfile_lines`).

A connection string carries a secret in three ways: the password of a URI's
user information (``postgresql://user:SECRET@host/db``), and the keywords
:data:`SECRET_KEYWORDS` (``password``, ``sslpassword``), as query parameters
of a URI (their names percent-encoded or not) or as keywords of a
keyword/value string (``host=db password=SECRET``). ``passfile`` and
``sslkey`` are paths, not secrets. Python's ``urllib`` does not split a URI
where libpq does (libpq takes the user information up to the first ``@``
before any ``/``, so ``?`` and ``#`` may be part of a password, and ``#``
starts no fragment; a query's ``+`` is not a space), so the URI is cut
here by libpq's own rules (``conninfo_uri_parse_options`` in libpq's
``fe-connect.c``); ``tests/test_fuzz_store.py`` holds the two to agreement.
"""

from __future__ import annotations

import re
import urllib.parse

URI_PREFIXES = ("postgresql://", "postgres://")
SECRET_KEYWORDS = frozenset({"password", "sslpassword"})
# The keywords of libpq's that a keyword/value string is most likely to begin
# with: what tells one from a file's name that has an "=" in it.
_LIBPQ_KEYWORDS = frozenset({
    "host", "hostaddr", "port", "dbname", "user", "password", "passfile", "service",
    "sslmode", "sslpassword", "sslkey", "sslcert", "sslrootcert", "options",
    "application_name", "connect_timeout", "target_session_attrs", "channel_binding",
    "gssencmode", "require_auth", "load_balance_hosts", "krbsrvname", "requiressl"})
# What stands for a connection string that cannot be read, where one is shown.
UNREADABLE = "(a database connection string that cannot be read)"
# C isspace(): what libpq skips between keywords and values.
_SPACE = " \t\n\r\v\f"
_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")


class ConninfoError(ValueError):
    """A connection string that libpq or blockdiff cannot use; the message
    says why and holds no part of the string."""


def is_url(target) -> bool:
    """Whether ``target`` is a PostgreSQL URI (``postgresql://``,
    ``postgres://``, as libpq spells them) rather than a SQLite file."""
    return isinstance(target, str) and target.startswith(URI_PREFIXES)


def _keyword_form(target) -> bool:
    """Whether ``target`` may be a keyword/value string, for scrubbing:
    whatever begins with a keyword and ``=``."""
    return isinstance(target, str) and re.match(r"\s*[A-Za-z_]+\s*=", target) is not None


def looks_like_keywords(target) -> bool:
    """Whether ``target`` reads as a libpq keyword/value string
    (``host=db dbname=x``: it begins with a libpq keyword) rather than a
    file's path."""
    found = isinstance(target, str) and re.match(r"\s*([A-Za-z_]+)\s*=", target)
    return bool(found) and found.group(1) in _LIBPQ_KEYWORDS


def _decode(text: str) -> str:
    """libpq's percent-decoding of a URI part (no ``+`` for a space; libpq
    18 drops the spaces around it, as here, and refuses spaces within)."""
    text = text.strip(" ")
    if _PERCENT.search(text):
        raise ConninfoError("it has a % that does not start a percent-encoded byte")
    raw = bytearray()
    i = 0
    while i < len(text):
        if text[i] == "%":
            raw.append(int(text[i + 1:i + 3], 16))
            i += 3
        else:
            raw += text[i].encode("utf-8", "surrogatepass")
            i += 1
    if 0 in raw:
        raise ConninfoError("it has a percent-encoded NUL byte")
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise ConninfoError("it has percent-encoded bytes that are not UTF-8") from None


def _split_uri(url: str):
    """``(prefix, user, password, middle, hosts, dbname, params)`` of a URI,
    raw (not decoded): ``middle`` the text of the hosts and the path,
    ``hosts`` ``[(host, port)]``, ``params`` the ``key=value`` pieces of the
    query (None without one). Raises ConninfoError where libpq would refuse
    the structure."""
    prefix = next(p for p in URI_PREFIXES if url.startswith(p))
    rest = url[len(prefix):]
    user = password = None
    at = re.match(r"[^@/]*", rest).end()
    if at < len(rest) and rest[at] == "@":
        user, colon, secret = rest[:at].partition(":")
        password = secret if colon else None
        rest = rest[at + 1:]
    hosts = []
    p = 0
    while True:
        if rest[p:p + 1] == "[":
            end = rest.find("]", p)
            if end < 0:
                raise ConninfoError('an IPv6 host address has no closing "]"')
            if end == p + 1:
                raise ConninfoError("an IPv6 host address is empty")
            host, p = rest[p:end + 1], end + 1
            if p < len(rest) and rest[p] not in ":/?,":
                raise ConninfoError('an IPv6 host address is followed by something other '
                                    'than ":", "/", "?" or ","')
        else:
            host_end = re.compile(r"[^:/?,]*").match(rest, p).end()
            host, p = rest[p:host_end], host_end
        port = None
        if rest[p:p + 1] == ":":
            port_end = re.compile(r"[^/?,]*").match(rest, p + 1).end()
            port, p = rest[p + 1:port_end], port_end
        hosts.append((host, port))
        if rest[p:p + 1] != ",":
            break
        p += 1
    dbname = None
    if rest[p:p + 1] == "/":
        end = rest.find("?", p)
        end = len(rest) if end < 0 else end
        dbname, p = rest[p + 1:end], end
    params = None
    if rest[p:p + 1] == "?":
        # As libpq cuts them: "&" ends a parameter, one at the very end none.
        query = rest[p + 1:]
        params = query.removesuffix("&").split("&") if query else []
    return prefix, user, password, rest[:p], hosts, dbname, params


def _param_keyword(piece: str) -> str:
    """A query parameter's keyword as libpq reads it (decoded), or as written
    when it cannot be decoded."""
    key = piece.partition("=")[0]
    try:
        return _decode(key)
    except ConninfoError:
        return key


def _keyword_pairs(conninfo: str):
    """``[(keyword, value, raw text)]`` of a keyword/value string, read as
    libpq's ``conninfo_parse`` reads it. Raises ConninfoError where libpq would."""
    pairs = []
    n = len(conninfo)
    p = 0
    while True:
        while p < n and conninfo[p] in _SPACE:
            p += 1
        if p == n:
            return pairs
        start = p
        while p < n and conninfo[p] != "=" and conninfo[p] not in _SPACE:
            p += 1
        keyword = conninfo[start:p]
        while p < n and conninfo[p] in _SPACE:
            p += 1
        if p == n or conninfo[p] != "=" or not keyword:
            raise ConninfoError('a keyword has no "=" after it')
        p += 1
        while p < n and conninfo[p] in _SPACE:
            p += 1
        value = []
        quoted = p < n and conninfo[p] == "'"
        p += quoted
        while True:
            if p == n:
                if quoted:
                    raise ConninfoError("a quoted value has no closing quote")
                break
            c = conninfo[p]
            if not quoted and c in _SPACE:
                break
            if quoted and c == "'":
                p += 1
                break
            if c == "\\" and p + 1 < n:
                p += 1
                c = conninfo[p]
            value.append(c)
            p += 1
        pairs.append((keyword, "".join(value), conninfo[start:p]))


def public_url(target: str) -> str:
    """``target`` as it may be shown or stored: a URI without its user
    information's password and without any ``password`` or ``sslpassword``
    parameter; a keyword/value string without those keywords. Of a string
    that cannot be read only the scheme is shown (``postgresql://...``), or
    :data:`UNREADABLE`: any of the rest could be a secret."""
    if is_url(target):
        try:
            prefix, user, _, middle, _, _, params = _split_uri(target)
        except ConninfoError:
            # The structure is libpq's error; what comes before the hosts
            # may be a password, what follows may hold one too.
            return next(p for p in URI_PREFIXES if target.startswith(p)) + "..."
        kept = [piece for piece in params or ()
                if _param_keyword(piece).strip().lower() not in SECRET_KEYWORDS]
        return (prefix + (f"{user}@" if user is not None else "") + middle
                + ("?" + "&".join(kept) if kept else ""))
    if _keyword_form(target):
        try:
            pairs = _keyword_pairs(target)
        except ConninfoError:
            return UNREADABLE
        return " ".join(raw for keyword, _, raw in pairs
                        if keyword.lower() not in SECRET_KEYWORDS)
    return target


def secrets_of(target: str) -> dict[str, str]:
    """The secrets ``target`` carries, by keyword (``password``,
    ``sslpassword``), decoded as libpq decodes them; a later one of a
    keyword wins, as in libpq. Raises ConninfoError if it cannot be read."""
    found = {}
    if is_url(target):
        _, _, password, _, _, _, params = _split_uri(target)
        if password:        # libpq sets it only if not empty
            found["password"] = _decode(password)
        for piece in params or ():
            keyword, _, value = piece.partition("=")
            if _decode(keyword) in SECRET_KEYWORDS:
                found[_decode(keyword)] = _decode(value)
    elif _keyword_form(target):
        found = {k: v for k, v, _ in _keyword_pairs(target) if k in SECRET_KEYWORDS}
    return found


def scrub(text: str, target: str, extra=()) -> str:
    """``text`` (a message about ``target``, libpq's, which may quote it)
    without ``target`` or any of its secrets (and the strings ``extra``):
    the URL as a whole becomes its public form, each secret ``***``."""
    if target:
        text = text.replace(target, public_url(target))
    secrets = list(extra)
    try:
        secrets += secrets_of(target).values()
    except ConninfoError:
        pass
    if is_url(target):
        # Raw, as written: libpq may quote the parts before decoding them.
        try:
            _, _, password, _, _, _, params = _split_uri(target)
            secrets += [password or ""] + [
                piece.partition("=")[2] for piece in params or ()
                if _param_keyword(piece).strip().lower() in SECRET_KEYWORDS]
        except ConninfoError:
            pass
    # The longest first, so that a secret containing another goes whole.
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def check_url(url: str) -> None:
    """Refuse (ConninfoError) a PostgreSQL URI libpq would not read or that
    names a port that is not one (a number from 1 to 65535), before any of
    it is stored or any connection is tried."""
    if "\0" in url:
        raise ConninfoError("it has a NUL character")
    if any(c in url for c in _SPACE):
        # libpq's versions read them differently (18 drops some, refuses others).
        raise ConninfoError("it has a space or a line break: percent-encode it (%20)")
    _, user, password, _, hosts, dbname, params = _split_uri(url)
    for part in (user, password, dbname):
        if part is not None:
            _decode(part)
    ports = []
    for host, port in hosts:
        _decode(host)
        if port is not None:
            ports.append(_decode(port))
    for piece in params or ():
        keyword, equals, value = piece.partition("=")
        if not equals or "=" in value:
            raise ConninfoError("a query parameter is not one keyword=value")
        if _decode(keyword) == "port":
            ports += _decode(value).split(",")
        _decode(value)
    for port in ports:
        if port and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
            raise ConninfoError("a port is not a number from 1 to 65535")


def refusal(url: str, error: ConninfoError) -> str:
    """The message refusing ``url`` for ``error``. The URL is shown by its
    scheme only: libpq did not read it, so a part it would not take for a
    password may still be the one its writer meant (``user:pa/ss@host``)."""
    scheme = next((p for p in URI_PREFIXES if url.startswith(p)), "")
    return f"the database URL {scheme}... cannot be used: {error}"


def passfile_lines(url: str, password: str) -> list[str]:
    """The lines of a libpq passfile that give ``password`` to the
    connections ``url`` makes, and to no other host, port, database or user.

    The fields are matched as libpq matches them (``passwordFromFile``): the
    host as it connects to it, decoded and with its case kept (a socket
    directory is a path, ``/run/Postgres``); a socket directory that is
    libpq's default (which libpq was built with: not known here) is matched
    as ``localhost``, so a socket host gets that line too. A port, database
    or user the URL leaves to libpq's defaults (``PGPORT``, ``PGUSER``, the
    login name) is ``*``: whatever they are when it connects."""
    if any(c in password for c in "\r\n"):
        raise ConninfoError("its password has a line break, which libpq's passfile cannot "
                            "hold; give it in PGPASSWORD or ~/.pgpass instead")
    fields = url_fields(url)
    hosts = (fields.get("host") or fields.get("hostaddr") or "").split(",")
    ports = (fields.get("port") or "").split(",")
    if len(ports) == 1:
        ports *= len(hosts)
    lines = []
    for host, port in zip(hosts, ports):
        candidates = [host or "*"]
        if host.startswith(("/", "@")):
            candidates.append("localhost")
        for name in candidates:
            line = ":".join(_field(v) for v in (name, port or "*", fields.get("dbname") or "*",
                                                fields.get("user") or "*"))
            lines.append(f"{line}:{_field(password, wildcard=False)}")
    return list(dict.fromkeys(lines))


def _field(value: str, *, wildcard: bool = True) -> str:
    if wildcard and value == "*":
        return value
    escaped = value.replace("\\", "\\\\").replace(":", "\\:")
    # libpq takes a line whose first character is # as a comment.
    return "\\" + escaped if escaped.startswith("#") else escaped


def with_parameter(url: str, keyword: str, value: str) -> str:
    """``url`` with the query parameter ``keyword=value`` added (percent-encoded)
    after its own, which are kept as written (libpq's, not re-encoded: a
    ``+`` stays a ``+``); libpq takes the last of a keyword given twice."""
    params = _split_uri(url)[-1]
    separator = "?" if params is None else "" if url.endswith(("?", "&")) else "&"
    return f"{url}{separator}{keyword}={urllib.parse.quote(value, safe='/')}"


def url_fields(url: str) -> dict[str, str]:
    """The keywords a URI sets, decoded as libpq decodes them (a query
    parameter over the part of the URI before it; several hosts and ports
    joined by commas). Raises ConninfoError if it cannot be read."""
    _, user, password, _, hosts, dbname, params = _split_uri(url)
    fields = {}
    if user:            # libpq sets these only if not empty, as written
        fields["user"] = _decode(user)
    if password:
        fields["password"] = _decode(password)
    # Joined as libpq joins them, set if the joined text is not empty.
    names = ",".join(h[1:-1] if h.startswith("[") else h for h, _ in hosts)
    if names:
        fields["host"] = _decode(names)
    ports = ",".join(p or "" for _, p in hosts)
    if ports:
        fields["port"] = _decode(ports)
    if dbname:
        fields["dbname"] = _decode(dbname)
    for piece in params or ():
        keyword, _, value = (_decode(part) for part in piece.partition("="))
        if (keyword, value) == ("ssl", "true"):       # libpq's JDBC spelling
            keyword, value = "sslmode", "require"
        fields[keyword] = value
    return fields
