# The compiled extension (ffi/module.cc).
from typing import Any

with_cuda: bool
with_sm90a: bool
decode_resident_blocks: int
ffi_api_minor: int

def registrations() -> dict[str, dict[str, Any]]: ...
