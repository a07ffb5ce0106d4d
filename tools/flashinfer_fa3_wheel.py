"""FlashInfer's trimmed wheel with its Hopper (fa3) batch prefill too, for the GPU benchmark's
peers (issue 68): ../shared/peer-wheels/trim_flashinfer_wheel.py keeps the sources of the fa2
modules only; this runs it with the sm90 batch prefill module's sources added (bf16/f16 and fp8,
paged and ragged; the CUTLASS headers they include come along whole).

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
      --implementation cp --platform manylinux_2_28_x86_64 -d UP flashinfer-python==0.7.2.post1
    python3 tools/flashinfer_fa3_wheel.py UP/flashinfer_python-0.7.2.post1-py3-none-any.whl \\
      build/peer-wheels-fa3 [--trim ../shared/peer-wheels/trim_flashinfer_wheel.py]

The result (version 0.7.2.post1+attnfa3) replaces the trimmed wheel of ../shared/peer-wheels in
a copy of that folder (the apache_tvm_ffi wheel and setup_on_gpu.sh are copied beside it).
"""

import argparse
import importlib.util
import pathlib
import shutil
import sys

# flashinfer/jit/attention/modules.py, gen_batch_prefill_module(backend="fa3"): the sources it
# renders and compiles (16-bit, then fp8 q/kv).
FA3_SOURCES = [
    "batch_prefill_sm90_customize_config.jinja",
    "batch_prefill_paged_sm90_kernel_inst.jinja",
    "batch_prefill_ragged_sm90_kernel_inst.jinja",
    "batch_prefill_sm90.cu",
    "batch_prefill_sm90_jit_binding.cu",
    "batch_prefill_fp8_paged_sm90_kernel_inst.jinja",
    "batch_prefill_fp8_ragged_sm90_kernel_inst.jinja",
    "batch_prefill_fp8_sm90.cu",
]


def main() -> None:
    root = pathlib.Path(__file__).resolve().parents[1]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel")
    ap.add_argument("out_dir")
    ap.add_argument("--trim",
                    default=str(root.parent / "shared/peer-wheels/trim_flashinfer_wheel.py"))
    args = ap.parse_args()
    trim_path = pathlib.Path(args.trim)
    spec = importlib.util.spec_from_file_location("trim_flashinfer_wheel", trim_path)
    trim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trim)
    trim.MODULES["batch_prefill_fa3"] = FA3_SOURCES
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sys.argv = [str(trim_path), args.wheel, str(out), "--label", "attnfa3",
                "--modules", "page,batch_decode,batch_prefill_fa2,batch_prefill_fa3"]
    trim.main()
    beside = [*trim_path.parent.glob("apache_tvm_ffi-*.whl"), trim_path.parent / "setup_on_gpu.sh"]
    for extra in beside:
        shutil.copy(extra, out / extra.name)


if __name__ == "__main__":
    main()
