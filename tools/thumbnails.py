"""Template thumbnails, step 2 (step 1: tools/thumbnails.mjs): crop each RAW_DIR/NAME.png to its graph box,
resize to 512 px wide (fit in 512x384 on the canvas background when taller), save OUT_DIR/NAME.jpg at JPEG
quality 80.   python tools/thumbnails.py RAW_DIR example_workflows"""
import json
import pathlib
import sys

from PIL import Image

W, H, MAX_BYTES = 512, 384, 80 * 1024
raw, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
for png in sorted(raw.glob("*.png")):
    meta = json.loads(png.with_suffix(".json").read_text())
    img = Image.open(png).convert("RGB").crop(tuple(meta["crop"]))
    bg = img.getpixel((1, 1))  # a corner of the padding: the canvas background as drawn
    w, h = W, round(img.height * W / img.width)
    if h > H:
        w, h = round(img.width * H / img.height), H
    img = img.resize((w, h), Image.LANCZOS)
    if h == H and w < W:
        sheet = Image.new("RGB", (W, H), bg)
        sheet.paste(img, ((W - w) // 2, 0))
        img = sheet
    dst = out / (png.stem + ".jpg")
    img.save(dst, "JPEG", quality=80, optimize=True)
    size = dst.stat().st_size
    print(f"{dst}: {img.width}x{img.height}, {size} bytes, bg {bg}" + ("  OVER 80 KB" if size >= MAX_BYTES else ""))
