"""Images in chat messages (vision models): the content parts
`{"type": "image_url", "image_url": {"url": ...}}` of OpenAI's chat API.

A url is a base64 data URL (`data:image/png;base64,...`) or a local file
(`file:///abs/path` or a plain path, relative ones under the root), read
only from under the image root the server was started with: the path is
resolved (symlinks and `..` followed) and must stay inside the root. No
root: no local files. http(s) URLs are refused (the server downloads
nothing). Each refusal is an `ApiError` 400 naming the problem.

The prompt: the chat template renders each image as a marker string, the
text between markers is tokenized, and each marker becomes
<|vision_start|><|image_pad|><|vision_end|> (as Qwen3-VL's template writes
an image); the engine widens the pad to the image's tokens.
"""

from __future__ import annotations

import base64
import binascii
import os
import urllib.parse

from jaxinfer.serving.openai_protocol import ApiError, encode

MARKER = "\x00<image>\x00"  # what an image renders as in the chat template


class ImageLoader:
  """Image urls -> bytes, local files only under `root` (None: none)."""

  def __init__(self, root: str | None, max_bytes: int = 32 << 20):
    if root is not None and not os.path.isdir(root):
      raise ValueError(f"image_root: {root!r} is not a directory")
    self.root = os.path.realpath(root) if root is not None else None
    self.max_bytes = max_bytes

  def load(self, url) -> bytes:
    if not isinstance(url, str) or not url:
      raise _bad(f"image_url.url must be a non-empty string, got {type(url).__name__}")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
      raise _bad("image_url: http(s) URLs are not fetched by this server (no downloads); "
                 "send a base64 data URL or a file path under the server's image root")
    if scheme == "data":
      return self._data_url(url)
    if scheme == "file":
      url = urllib.parse.unquote(urllib.parse.urlparse(url).path)
    elif scheme and len(scheme) > 1:
      raise _bad(f"image_url: unsupported URL scheme {scheme!r} (use a data URL or a file path)")
    return self._file(url)

  def _data_url(self, url: str) -> bytes:
    head, _, payload = url.partition(",")
    if not head.endswith(";base64"):
      raise _bad("image_url: a data URL must be base64 (data:image/...;base64,...)")
    try:
      data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
      raise _bad(f"image_url: the data URL is not valid base64: {e}") from None
    if len(data) > self.max_bytes:
      raise _bad(f"image_url: the image has {len(data)} bytes, over {self.max_bytes}")
    return data

  def _file(self, path: str) -> bytes:
    if self.root is None:
      raise _bad("image_url: local image paths are refused: the server has no image root "
                 "(send a base64 data URL)")
    real = os.path.realpath(os.path.join(self.root, path))  # an absolute path replaces root
    if os.path.commonpath([real, self.root]) != self.root:
      raise _bad(f"image_url: the path {path!r} is outside the server's image root")
    if not os.path.isfile(real):
      raise _bad(f"image_url: no image file at {path!r} under the image root")
    if os.path.getsize(real) > self.max_bytes:
      raise _bad(f"image_url: the file {path!r} is over {self.max_bytes} bytes")
    with open(real, "rb") as f:
      return f.read()


def _bad(message: str) -> ApiError:
  return ApiError(400, message, param="messages", code="invalid_image")


def image_urls(messages) -> list:
  """The messages' image urls, in order."""
  urls = []
  for m in messages:
    for part in m.content if isinstance(m.content, list) else ():
      if part.type == "image_url":
        urls.append(part.url)
  return urls


def prompt_ids(text: str, tokenizer, vision) -> list[int]:
  """A rendered chat prompt with image markers -> token ids (the markers as
  vision start, image pad, vision end; vision: the model's VisionConfig)."""
  pieces = text.split(MARKER)
  ids = encode(tokenizer, pieces[0], special=False)
  for piece in pieces[1:]:
    ids += [vision.vision_start_token_id, vision.image_token_id, vision.vision_end_token_id]
    ids += encode(tokenizer, piece, special=False)
  return ids
