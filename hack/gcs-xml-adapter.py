#!/usr/bin/env python3
"""The write half of GCS's XML API in front of fake-gcs-server (hack/gcs-server.sh starts both).

fake-gcs-server serves GCS's JSON API and the XML API's reads, but not the XML API's uploads
(its issue 1164), which is what object_store's GCS client writes with: a plain PUT of an object,
a PUT with `x-goog-copy-source`, and multipart uploads (`?uploads`, `?partNumber&uploadId`,
`?uploadId`). This proxy turns each of those into the JSON API call that does the same on the
server (a media upload, a copyTo) with the generation precondition (`x-goog-if-generation-match`)
carried as `ifGenerationMatch`, so create-only commits are refused by the server itself; a
multipart upload's parts wait here until the upload completes and are then uploaded whole.
Every other request (reads, ranges, lists, deletes) passes through unchanged.

    gcs-xml-adapter.py LISTEN_PORT UPSTREAM_PORT
"""

import hashlib
import http.client
import http.server
import json
import re
import sys
import threading
import urllib.parse
import uuid

HOST = "127.0.0.1"
UPSTREAM = (HOST, int(sys.argv[2]))
UPLOADS = {}  # upload id -> {part number: bytes}
LOCK = threading.Lock()
HOP = {"connection", "keep-alive", "transfer-encoding", "host", "content-length"}


def upstream(method, target, body=b"", headers=None):
    conn = http.client.HTTPConnection(*UPSTREAM, timeout=120)
    try:
        hdrs = dict(headers or {})
        hdrs["Host"] = f"{UPSTREAM[0]}:{UPSTREAM[1]}"
        hdrs["Content-Length"] = str(len(body))
        conn.request(method, target, body=body, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, resp.getheaders(), resp.read()
    finally:
        conn.close()


class Adapter(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def body(self):
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def reply(self, status, body=b"", headers=()):
        self.send_response(status)
        length = str(len(body))
        for k, v in headers:
            if k.lower() == "content-length" and self.command == "HEAD":
                length = v  # a HEAD's answer has no body but says the object's length
            elif k.lower() not in HOP:
                self.send_header(k, v)
        self.send_header("Content-Length", length)
        self.end_headers()
        if self.command != "HEAD":
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                # The client stopped reading (a stream it dropped): nothing to answer.
                self.close_connection = True

    def passthrough(self):
        hdrs = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
        status, headers, body = upstream(self.command, self.path, self.body(), hdrs)
        self.reply(status, body, headers)

    def target(self):
        """(bucket, object name, query) of an XML API object URL, or None."""
        url = urllib.parse.urlsplit(self.path)
        m = re.fullmatch(r"/([^/]+)/(.+)", url.path)
        if not m or m.group(1) in ("storage", "upload", "download", "batch", "_internal"):
            return None
        query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
        return urllib.parse.unquote(m.group(1)), urllib.parse.unquote(m.group(2)), query

    def precondition(self):
        g = self.headers.get("x-goog-if-generation-match")
        return {} if g is None else {"ifGenerationMatch": g}

    def created(self, status, body, xml_result=None):
        """Relays the JSON API's answer to an upload as the XML API answers one."""
        if status != 200:
            self.reply(status, body, [("Content-Type", "application/json")])
            return
        obj = json.loads(body)
        etag = obj.get("etag") or obj.get("md5Hash") or ""
        headers = [("ETag", f'"{etag}"'), ("x-goog-generation", str(obj.get("generation", "")))]
        if xml_result is None:
            self.reply(200, b"", headers)
        else:
            xml = (
                "<CompleteMultipartUploadResult><Bucket>{}</Bucket><Key>{}</Key>"
                '<ETag>"{}"</ETag></CompleteMultipartUploadResult>'
            ).format(*xml_result, etag)
            self.reply(200, xml.encode(), headers + [("Content-Type", "application/xml")])

    def upload(self, bucket, name, data, content_type):
        query = {"uploadType": "media", "name": name, **self.precondition()}
        target = f"/upload/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o?" + urllib.parse.urlencode(query)
        return upstream("POST", target, data, {"Content-Type": content_type})

    def do_PUT(self):
        t = self.target()
        if t is None:
            return self.passthrough()
        bucket, name, query = t
        data = self.body()
        if "uploadId" in query and "partNumber" in query:
            with LOCK:
                parts = UPLOADS.get(query["uploadId"][0])
                if parts is None:
                    return self.reply(404, b"no such upload")
                parts[int(query["partNumber"][0])] = data
            return self.reply(200, b"", [("ETag", f'"{hashlib.md5(data).hexdigest()}"')])
        source = self.headers.get("x-goog-copy-source")
        if source is not None:
            src_bucket, _, src_name = urllib.parse.unquote(source).lstrip("/").partition("/")
            q = lambda s: urllib.parse.quote(s, safe="")
            target = f"/storage/v1/b/{q(src_bucket)}/o/{q(src_name)}/copyTo/b/{q(bucket)}/o/{q(name)}"
            if self.precondition():
                target += "?" + urllib.parse.urlencode(self.precondition())
            status, _, body = upstream("POST", target, b"{}", {"Content-Type": "application/json"})
            return self.created(status, body)
        ctype = self.headers.get("Content-Type", "application/octet-stream")
        self.created(*self.upload(bucket, name, data, ctype)[::2])

    def do_POST(self):
        t = self.target()
        if t is None:
            return self.passthrough()
        bucket, name, query = t
        if "uploads" in query:
            self.body()
            upload_id = uuid.uuid4().hex
            with LOCK:
                UPLOADS[upload_id] = {}
            xml = (
                "<InitiateMultipartUploadResult><Bucket>{}</Bucket><Key>{}</Key>"
                "<UploadId>{}</UploadId></InitiateMultipartUploadResult>"
            ).format(bucket, name, upload_id)
            return self.reply(200, xml.encode(), [("Content-Type", "application/xml")])
        if "uploadId" in query:
            listed = [int(n) for n in re.findall(rb"<PartNumber>(\d+)</PartNumber>", self.body())]
            with LOCK:
                parts = UPLOADS.pop(query["uploadId"][0], None)
            if parts is None or any(n not in parts for n in listed):
                return self.reply(400, b"unknown upload or part")
            data = b"".join(parts[n] for n in listed)
            status, _, body = self.upload(bucket, name, data, "application/octet-stream")
            return self.created(status, body, (bucket, name))
        self.passthrough()

    def do_DELETE(self):
        t = self.target()
        if t is not None and "uploadId" in t[2]:
            with LOCK:
                UPLOADS.pop(t[2]["uploadId"][0], None)
            return self.reply(204)
        self.passthrough()

    def do_GET(self):
        self.passthrough()

    def do_HEAD(self):
        self.passthrough()


if __name__ == "__main__":
    server = http.server.ThreadingHTTPServer((HOST, int(sys.argv[1])), Adapter)
    server.daemon_threads = True
    server.serve_forever()
