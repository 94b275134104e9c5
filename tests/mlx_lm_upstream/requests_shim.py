"""The part of ``requests`` that mlx-lm's server tests use, on urllib, so
that they run without it (it is not a dependency of this project)."""

import json as jsonlib
import urllib.error
import urllib.request


class Response:
    def __init__(self, raw):
        self._raw = raw
        self.status_code = raw.status
        self.headers = raw.headers
        self._content = None

    @property
    def content(self) -> bytes:
        if self._content is None:
            self._content = self._raw.read()
        return self._content

    @property
    def text(self) -> str:
        return self.content.decode()

    def json(self):
        return jsonlib.loads(self.content)

    def iter_lines(self):
        for line in self._raw:
            yield line.rstrip(b"\r\n")


def request(method, url, json=None, stream=False, timeout=None):
    data = None if json is None else jsonlib.dumps(json).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        raw = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as error:
        raw = error
    response = Response(raw)
    if not stream:
        response.content
    return response


def get(url, **kwargs):
    return request("GET", url, **kwargs)


def post(url, **kwargs):
    return request("POST", url, **kwargs)
