"""Rebuild a model that benchmarks/papers/trime/device_train.sh trained on a GPU machine and sent back in parts.

    python benchmarks/papers/trime/device_unpack.py FILES_DIR NAME DEST

joins FILES_DIR/NAME.tar.part-*, unpacks the folder NAME (a `memlm train` final model with float16 weights, its
training log and the command) and writes it to DEST with the weights cast back to float32 (the float16 rounding of
transport stays: relative error <= 2**-11 per weight).
"""

from __future__ import annotations

import io
import shutil
import sys
import tarfile
from pathlib import Path

from safetensors.torch import load_file, save_file


def main() -> None:
    files, name, dest = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    parts = sorted(files.glob(f"{name}.tar.part-*"))
    if not parts:
        sys.exit(f"no {name}.tar.part-* in {files}")
    data = b"".join(p.read_bytes() for p in parts)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(tmp, filter="data")
    src = tmp / name
    for f in src.glob("*.safetensors"):
        t = load_file(f)
        save_file({k: (v.float() if v.is_floating_point() else v) for k, v in t.items()}, f, metadata={"format": "pt"})
    shutil.rmtree(dest, ignore_errors=True)
    src.rename(dest)
    shutil.rmtree(tmp)
    print(f"{dest}: " + ", ".join(sorted(p.name for p in dest.iterdir())))


if __name__ == "__main__":
    main()
