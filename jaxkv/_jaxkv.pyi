# The compiled extension (ffi/module.cc).
from typing import Any

with_cuda: bool
with_sm90a: bool
ffi_api_minor: int

def registrations() -> dict[str, dict[str, Any]]: ...
