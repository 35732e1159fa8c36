"""`moto_server`, with S3's conditional writes decided atomically, as S3 decides them.

    python tests/atomic_moto_server.py -H 127.0.0.1 -p PORT

moto checks a write's `If-Match` / `If-None-Match` and then writes, with no lock between
the two, on whichever of its request threads serves it: two conditional writes of one key
that arrive together can both pass the check. Seen once in CI: five attempts claiming one
run at the same instant were handed 1, 2, 3, 3, 4. S3 itself decides them one at a time,
and the commit protocol relies on that (the pointer's `If-Match`, an upload's
`If-None-Match: *`). So this server takes one lock around moto's object writes (a PUT, a
DELETE, the POST that completes a multipart upload), which run once the request's body has
been read, and is otherwise `moto.server`.
"""

import functools
import threading

from moto.s3.responses import S3Response
from moto.server import main

_WRITES = threading.Lock()


def _one_at_a_time(method):
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with _WRITES:
            return method(self, *args, **kwargs)

    return call


for _name in ("put_object", "delete_object", "_key_response_post"):
    setattr(S3Response, _name, _one_at_a_time(getattr(S3Response, _name)))

if __name__ == "__main__":
    main()
