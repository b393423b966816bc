"""Text holding lone surrogates (a task id, a queue or task name) on the dashboard's pages and in
its URLs.

kombu-delay indexes a task id that holds lone surrogates (``os.fsdecode`` of bytes that are not
UTF-8, a JSON ``\\udcff`` escape) by its UTF-8 bytes with the surrogates encoded as they are
(:func:`kombu_delay.message.id_arg`). A page is UTF-8 and a URL percent-encoded UTF-8, and
neither can hold such a character as it is, so the dashboard:

* shows each lone surrogate on a page as its Python escape, ``\\udcff``, as ``kombu-delay ls``
  does (:func:`visible`, what every template writes goes through it);
* writes it in a URL's query as those same bytes, percent-encoded (``%ED%B3%BF``:
  :func:`encode_query`), and reads them back as the surrogate, in the query and in a form's body
  alike (:class:`DashboardRequest`). Valid UTF-8 reads as before, and any other byte that is not
  UTF-8 stays percent-encoded, as Werkzeug leaves it. So a link to a task, and the forms of its
  page (which carry the id in their ``action`` URL), name exactly the id they were made from.
"""

from __future__ import annotations

import codecs
import re
from typing import IO, Any, cast
from urllib.parse import parse_qsl, quote

from flask import Request
from markupsafe import Markup
from werkzeug.datastructures import MultiDict
from werkzeug.formparser import FormDataParser
from werkzeug.utils import cached_property

#: A surrogate code point: in a Python string, every one is lone.
_SURROGATE = re.compile("[\ud800-\udfff]")
#: The codec error handler that reads a URL's bytes (registered below).
ERRORS = "kombu_delay.web.surrogates"
_surrogatepass = codecs.lookup_error("surrogatepass")


def _surrogate_or_quoted(exc: UnicodeError) -> tuple[str, int]:
    """Read a surrogate encoded as it is ("surrogatepass") as that surrogate, and any other byte
    that is not UTF-8 as its percent escape (as Werkzeug reads it)."""
    if not isinstance(exc, UnicodeDecodeError):
        raise exc
    try:
        text, end = _surrogatepass(exc)
    except UnicodeDecodeError:
        return quote(exc.object[exc.start : exc.end], safe=""), exc.end
    return cast(str, text), end  # decoding: the text the bytes stand for


codecs.register_error(ERRORS, _surrogate_or_quoted)


def read_query(text: bytes) -> list[tuple[str, str]]:
    """The fields of a query string or an urlencoded form, blank ones kept."""
    return parse_qsl(text.decode("utf-8", ERRORS), keep_blank_values=True, errors=ERRORS)


def has_surrogates(text: str) -> bool:
    return _SURROGATE.search(text) is not None


def visible(value: Any) -> Any:
    """The templates' ``finalize``: a text with each lone surrogate as its Python escape
    (``\\udcff``); anything else as it is."""
    if not isinstance(value, str) or not has_surrogates(value):
        return value
    shown = _SURROGATE.sub(lambda found: f"\\u{ord(found.group()):04x}", value)
    return Markup(shown) if isinstance(value, Markup) else shown


def encode_query(endpoint: str | None, values: dict[str, Any]) -> None:
    """The app's ``url_defaults``: a value holding lone surrogates goes into the URL as its UTF-8
    bytes, the surrogates encoded as they are (Werkzeug percent-encodes bytes as they are). Every
    route of the dashboard takes its values in the query, none in its path."""
    for key, value in values.items():
        if isinstance(value, str) and has_surrogates(value):
            values[key] = value.encode("utf-8", "surrogatepass")


class _FormParser(FormDataParser):
    def _parse_urlencoded(
        self, stream: IO[bytes], mimetype: str, content_length: int | None, options: dict[str, str]
    ) -> tuple[IO[bytes], MultiDict[str, Any], MultiDict[str, Any]]:
        return stream, self.cls(read_query(stream.read())), self.cls()


class DashboardRequest(Request):
    """A request whose query and urlencoded form read a surrogate encoded as it is."""

    form_data_parser_class = _FormParser

    @cached_property
    def args(self) -> MultiDict[str, str]:
        return self.parameter_storage_class(read_query(self.query_string))
