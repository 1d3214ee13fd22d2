#!/usr/bin/env bash
# Render a sweep's report.html in headless Chromium (Debian's `chromium`) with every host unresolvable, so only
# what the page embeds can show, and check the screenshot is non-trivial (decodes, right size, not
# a near-empty file, many distinct pixel patterns).
# Usage: experiments/loadgen/check_report.sh results/<ts>/report.html [out.png]    Exit 0 = ok, 2 = no chromium.
set -euo pipefail
report=$(realpath "$1")
png=${2:-${report%.html}.png}
browser=$(command -v chromium || command -v chromium-browser || true)
if [[ -z "$browser" ]]; then
    echo "check_report: no chromium on PATH (apt-get install -y chromium)" >&2
    exit 2
fi
rm -f "$png"
timeout 120 "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1400,2400 \
    --host-resolver-rules="MAP * ~NOTFOUND" --screenshot="$png" "file://$report" >/dev/null 2>&1
python3 - "$png" <<'PY'
import struct, sys, zlib
path = sys.argv[1]
data = open(path, "rb").read()
assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path}: not a PNG"
w, h = struct.unpack(">II", data[16:24])
assert (w, h) == (1400, 2400), f"{path}: {w}x{h}, expected 1400x2400"
# a blank or text-only page compresses to a few KB; the tables plus plots do not
assert len(data) > 40_000, f"{path}: only {len(data)} bytes: the page looks empty"
chunks, i = [], 8
while i < len(data):
    n, kind = struct.unpack(">I4s", data[i:i + 8])
    if kind == b"IDAT":
        chunks.append(data[i + 8:i + 8 + n])
    i += 12 + n
raw = zlib.decompress(b"".join(chunks))
distinct = len({raw[j:j + 3] for j in range(0, len(raw) - 3, 7)})
assert distinct > 200, f"{path}: only {distinct} distinct pixel patterns: the page looks blank"
print(f"check_report: {path} {w}x{h}, {len(data)} bytes, {distinct} distinct pixel patterns: ok")
PY
