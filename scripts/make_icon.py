"""Draws docs/icon.png, the pack's icon in the Comfy Registry and ComfyUI-Manager ([tool.comfy] Icon).

The registry's rules: PNG, SVG, JPG or GIF, square, at most 400 x 400 px, given as a URL (pyproject points at this
file on the main branch). A PNG renders wherever the registry or the Manager shows an <img>, whatever content type the
file is served with; an SVG from a raw file host may come as text/plain.

The picture: a red spider lily (Lycoris radiata, the flower LyCORIS is named after) on a dark tile. Drawn at 4x and
scaled down for smooth edges.

    .venv/bin/python scripts/make_icon.py
"""

import math
from pathlib import Path

from PIL import Image, ImageDraw

SIZE = 400
SCALE = 4
OUT = Path(__file__).resolve().parent.parent / "docs" / "icon.png"

BACKGROUND = (32, 33, 40)
PETAL = (214, 40, 57)
PETAL_DARK = (150, 22, 40)
STAMEN = (238, 92, 96)
ANTHER = (255, 214, 120)
STEM = (92, 150, 84)


def _bezier(p0, p1, p2, steps=48):
    return [
        ((1 - t) ** 2 * p0[0] + 2 * (1 - t) * t * p1[0] + t**2 * p2[0],
         (1 - t) ** 2 * p0[1] + 2 * (1 - t) * t * p1[1] + t**2 * p2[1])
        for t in (i / steps for i in range(steps + 1))
    ]


def _polar(center, radius, degrees):
    a = math.radians(degrees)
    return center[0] + radius * math.cos(a), center[1] - radius * math.sin(a)


def _petal(draw, center, angle, length, width, color):
    """A narrow petal curling back at its tip: two quadratic curves from the centre to the tip."""
    tip = _polar(center, length, angle)
    bend = angle - 28  # spider-lily petals recurve
    left = _polar(center, length * 0.55, bend + width)
    right = _polar(center, length * 0.55, bend - width)
    outline = _bezier(center, left, tip) + _bezier(tip, right, center)[1:]
    draw.polygon([(x * SCALE, y * SCALE) for x, y in outline], fill=color)


def _stamen(draw, center, angle, length):
    tip = _polar(center, length, angle)
    control = _polar(center, length * 0.6, angle + 22)
    points = [(x * SCALE, y * SCALE) for x, y in _bezier(center, control, tip)]
    draw.line(points, fill=STAMEN, width=3 * SCALE, joint="curve")
    r = 6 * SCALE
    draw.ellipse((tip[0] * SCALE - r, tip[1] * SCALE - r, tip[0] * SCALE + r, tip[1] * SCALE + r), fill=ANTHER)


def main() -> None:
    big = SIZE * SCALE
    image = Image.new("RGBA", (big, big), (0, 0, 0, 0))
    draw = ImageDraw.Draw(image)
    draw.rounded_rectangle((0, 0, big - 1, big - 1), radius=72 * SCALE, fill=BACKGROUND)

    center = (200, 232)
    stem = [(x * SCALE, y * SCALE) for x, y in _bezier((200, 372), (186, 300), center)]
    draw.line(stem, fill=STEM, width=9 * SCALE, joint="curve")

    for i in range(6):
        _petal(draw, center, 90 + 60 * i + 20, 92, 9, PETAL_DARK)
    for i in range(6):
        _petal(draw, center, 90 + 60 * i - 10, 104, 8, PETAL)
    for angle in (28, 58, 84, 104, 128, 152):
        _stamen(draw, center, angle, 150)
    r = 14 * SCALE
    draw.ellipse((center[0] * SCALE - r, center[1] * SCALE - r, center[0] * SCALE + r, center[1] * SCALE + r),
                 fill=PETAL_DARK)

    OUT.parent.mkdir(exist_ok=True)
    image.resize((SIZE, SIZE), Image.LANCZOS).save(OUT, optimize=True)
    print(f"{OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
