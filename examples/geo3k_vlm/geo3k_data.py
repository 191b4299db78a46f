"""geo3k data: a synthetic geometry-diagram generator, and the loader for geo3k-style datasets.

The generator draws small, clean diagrams with PIL (right and general triangles, circles, rectangles
and squares) and writes them in the geo3k schema, so the geo3k recipe runs offline on a laptop:

    {"id": "train-00000", "images": ["images/train-00000.png"], "kind": "right_hypotenuse",
     "problem": "<image>Find x.", "answer": "13"}

Every answer is exact: an integer, or an integer multiple of pi written `12\\pi` (circle problems ask
for the answer "in terms of \\pi", so the decimal 37.7 is *not* accepted for 12\\pi). Everything is a
pure function of (seed, index): the same seed gives byte-identical PNGs and identical rows.

`load_geo3k` reads the real geo3k parquet (hiyouga/geometry3k: `images` is a list of
`{"bytes", "path"}` dicts) as well as what the generator writes, and turns every row into a chat
prompt whose image parts sit where the problem's `<image>` placeholders were.
"""

from __future__ import annotations

import base64
import io
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from turnrl.types import Message

IMAGE_PLACEHOLDER = "<image>"
IMAGE_SIZE = 256
"""Width and height of every generated diagram, in pixels."""
REQUIRED_COLUMNS = ("images", "problem", "answer")

PYTHAGOREAN_TRIPLES = ((3, 4, 5), (5, 12, 13), (8, 15, 17), (7, 24, 25), (20, 21, 29), (9, 40, 41))

Point = tuple[float, float]


@dataclass(frozen=True)
class GeoProblem:
    """One generated problem: the diagram as PNG bytes plus its geo3k text and answer."""

    kind: str
    """Which template produced it (e.g. `right_hypotenuse`, `circle_area`)."""
    problem: str
    """The question, starting with one `<image>` placeholder."""
    answer: str
    """Exact answer as a LaTeX string: `13`, `58`, `12\\pi`."""
    png: bytes


# ---- drawing --------------------------------------------------------------------------------------


class _Canvas:
    """A white square image with black strokes and centred text labels (PIL's default font)."""

    def __init__(self) -> None:
        self.image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), "white")
        self.draw = ImageDraw.Draw(self.image)
        # load_default(size=...) gives the bundled FreeType font (degree sign included), or the
        # bitmap font when Pillow lacks FreeType; either way no font file is needed.
        self.font = ImageFont.load_default(size=17)

    def polygon(self, points: list[Point]) -> None:
        self.draw.polygon([_round(p) for p in points], outline="black", width=2)

    def segment(self, a: Point, b: Point) -> None:
        self.draw.line([_round(a), _round(b)], fill="black", width=2)

    def circle(self, center: Point, radius: float) -> None:
        x, y = center
        self.draw.ellipse([x - radius, y - radius, x + radius, y + radius], outline="black", width=2)

    def dot(self, center: Point) -> None:
        x, y = center
        self.draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill="black")

    def label(self, text: str, center: Point) -> None:
        left, top, right, bottom = self.draw.textbbox((0, 0), text, font=self.font)
        x = center[0] - (left + right) / 2
        y = center[1] - (top + bottom) / 2
        self.draw.text((round(x), round(y)), text, fill="black", font=self.font)

    def side_label(self, text: str, a: Point, b: Point, inside: Point) -> None:
        """Label segment ab at its midpoint, pushed away from the point `inside`."""
        mid = ((a[0] + b[0]) / 2, (a[1] + b[1]) / 2)
        normal = _unit((b[1] - a[1], a[0] - b[0]))
        if _dot(normal, (inside[0] - mid[0], inside[1] - mid[1])) > 0:
            normal = (-normal[0], -normal[1])
        self.label(text, (mid[0] + 16 * normal[0], mid[1] + 16 * normal[1]))

    def angle_label(self, text: str, vertex: Point, p: Point, q: Point) -> None:
        """Label the angle at `vertex` (between rays to p and q) inside it, along its bisector."""
        u, v = _unit(_sub(p, vertex)), _unit(_sub(q, vertex))
        bisector = _unit((u[0] + v[0], u[1] + v[1]))
        half_angle = math.acos(max(-1.0, min(1.0, _dot(u, v)))) / 2
        # Narrow angles need the label further in so it clears both sides.
        distance = min(48.0, max(22.0, 15 / math.sin(half_angle)))
        self.label(text, (vertex[0] + distance * bisector[0], vertex[1] + distance * bisector[1]))

    def right_angle_mark(self, vertex: Point, p: Point, q: Point, size: float = 12) -> None:
        u, v = _unit(_sub(p, vertex)), _unit(_sub(q, vertex))
        a = (vertex[0] + size * u[0], vertex[1] + size * u[1])
        c = (vertex[0] + size * v[0], vertex[1] + size * v[1])
        corner = (a[0] + size * v[0], a[1] + size * v[1])
        self.draw.line([_round(a), _round(corner), _round(c)], fill="black", width=2)

    def png(self) -> bytes:
        buffer = io.BytesIO()
        self.image.save(buffer, format="PNG")
        return buffer.getvalue()


def _round(p: Point) -> tuple[int, int]:
    return round(p[0]), round(p[1])


def _sub(a: Point, b: Point) -> Point:
    return a[0] - b[0], a[1] - b[1]


def _dot(a: Point, b: Point) -> float:
    return a[0] * b[0] + a[1] * b[1]


def _unit(v: Point) -> Point:
    norm = math.hypot(*v)
    return v[0] / norm, v[1] / norm


def _fit(points: list[Point], margin: float = 40) -> list[Point]:
    """Map math coordinates (y up) onto the canvas (y down), scaled uniformly and centred."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    width, height = max(xs) - min(xs), max(ys) - min(ys)
    scale = (IMAGE_SIZE - 2 * margin) / max(width, height)
    x0 = (IMAGE_SIZE - scale * width) / 2 - scale * min(xs)
    y0 = (IMAGE_SIZE + scale * height) / 2 + scale * min(ys)
    return [(x0 + scale * x, y0 - scale * y) for x, y in points]


def _centroid(points: list[Point]) -> Point:
    return sum(p[0] for p in points) / len(points), sum(p[1] for p in points) / len(points)


def _mirror(points: list[Point], rng: random.Random) -> list[Point]:
    sx, sy = rng.choice((1, -1)), rng.choice((1, -1))
    return [(sx * x, sy * y) for x, y in points]


# ---- problem templates ----------------------------------------------------------------------------


def _scaled_triple(rng: random.Random) -> tuple[int, int, int]:
    a, b, c = rng.choice(PYTHAGOREAN_TRIPLES)
    k = rng.randint(1, 3)
    if rng.random() < 0.5:
        a, b = b, a
    return k * a, k * b, k * c


def _right_triangle(rng: random.Random, a: int, b: int, labels: tuple[str, str, str]) -> bytes:
    """Legs a (horizontal) and b (vertical) meet at a right angle; `labels` name the two legs and the
    hypotenuse, in that order (an empty label leaves the side unlabelled)."""
    right, p, q = _fit(_mirror([(0.0, 0.0), (float(a), 0.0), (0.0, float(b))], rng))
    canvas = _Canvas()
    canvas.polygon([right, p, q])
    canvas.right_angle_mark(right, p, q)
    inside = _centroid([right, p, q])
    for text, (u, v) in zip(labels, ((right, p), (right, q), (p, q)), strict=True):
        if text:
            canvas.side_label(text, u, v, inside)
    return canvas.png()


def _right_hypotenuse(rng: random.Random) -> GeoProblem:
    a, b, c = _scaled_triple(rng)
    png = _right_triangle(rng, a, b, (str(a), str(b), "x"))
    return GeoProblem("right_hypotenuse", "<image>Find x.", str(c), png)


def _right_leg(rng: random.Random) -> GeoProblem:
    a, b, c = _scaled_triple(rng)
    png = _right_triangle(rng, a, b, ("x", str(b), str(c)))
    return GeoProblem("right_leg", "<image>Find x.", str(a), png)


def _right_area(rng: random.Random) -> GeoProblem:
    a, b, _ = _scaled_triple(rng)
    png = _right_triangle(rng, a, b, (str(a), str(b), ""))
    # One leg of a Pythagorean triple is even, so the area is an integer.
    return GeoProblem("right_area", "<image>Find the area of the triangle.", str(a * b // 2), png)


def _triangle_angle(rng: random.Random) -> GeoProblem:
    first = rng.randint(30, 100)
    second = rng.randint(25, 180 - first - 25)
    angles = [first, second, 180 - first - second]
    # Base from (0, 0) to (1, 0); the apex from the two base angles (law of sines).
    apex_distance = math.sin(math.radians(second)) / math.sin(math.radians(angles[2]))
    apex = (apex_distance * math.cos(math.radians(first)), apex_distance * math.sin(math.radians(first)))
    vertices = _fit(_mirror([(0.0, 0.0), (1.0, 0.0), apex], rng))
    unknown = rng.randrange(3)
    canvas = _Canvas()
    canvas.polygon(vertices)
    for i, vertex in enumerate(vertices):
        text = "x°" if i == unknown else f"{angles[i]}°"
        canvas.angle_label(text, vertex, vertices[(i + 1) % 3], vertices[(i + 2) % 3])
    return GeoProblem("triangle_angle", "<image>Find x.", str(angles[unknown]), canvas.png())


def _circle(rng: random.Random, quantity: str) -> GeoProblem:
    radius = rng.randint(2, 15)
    use_diameter = rng.random() < 0.5
    center, r_px = (IMAGE_SIZE / 2, IMAGE_SIZE / 2), IMAGE_SIZE / 2 - 40
    theta = math.radians(rng.choice((0, 30, 45, 150, 200, 330)))
    end = (center[0] + r_px * math.cos(theta), center[1] - r_px * math.sin(theta))
    start = (2 * center[0] - end[0], 2 * center[1] - end[1]) if use_diameter else center
    canvas = _Canvas()
    canvas.circle(center, r_px)
    canvas.dot(center)
    canvas.segment(start, end)
    # Label the half from the centre out (clear of the centre dot), on the far side of a point just
    # off that half's line.
    mid = ((center[0] + end[0]) / 2, (center[1] + end[1]) / 2)
    off_line = (mid[0] + 10 * math.sin(theta), mid[1] + 10 * math.cos(theta))
    canvas.side_label(str(2 * radius if use_diameter else radius), center, end, off_line)
    if quantity == "circumference":
        answer = f"{2 * radius}\\pi"
    else:
        answer = f"{radius * radius}\\pi"
    problem = f"<image>Find the {quantity} of the circle. Express your answer in terms of \\pi."
    return GeoProblem(f"circle_{quantity}", problem, answer, canvas.png())


def _quadrilateral(rng: random.Random, shape: str, quantity: str) -> GeoProblem:
    width = rng.randint(2, 20)
    # Aspect ratio at most 3, so thin rectangles stay legible.
    heights = [h for h in range(2, 21) if h != width and width <= 3 * h and h <= 3 * width]
    height = width if shape == "square" else rng.choice(heights)
    corners = _fit([(0.0, 0.0), (float(width), 0.0), (float(width), float(height)), (0.0, float(height))])
    canvas = _Canvas()
    canvas.polygon(corners)
    inside = _centroid(corners)
    canvas.side_label(str(width), corners[0], corners[1], inside)
    if shape == "rectangle":
        canvas.side_label(str(height), corners[1], corners[2], inside)
    for i, corner in enumerate(corners):
        canvas.right_angle_mark(corner, corners[i - 1], corners[(i + 1) % 4], size=10)
    value = width * height if quantity == "area" else 2 * (width + height)
    return GeoProblem(
        f"{shape}_{quantity}", f"<image>Find the {quantity} of the {shape}.", str(value), canvas.png()
    )


TEMPLATES: dict[str, Callable[[random.Random], GeoProblem]] = {
    "right_hypotenuse": _right_hypotenuse,
    "right_leg": _right_leg,
    "right_area": _right_area,
    "triangle_angle": _triangle_angle,
    "circle_circumference": lambda rng: _circle(rng, "circumference"),
    "circle_area": lambda rng: _circle(rng, "area"),
    "rectangle_area": lambda rng: _quadrilateral(rng, "rectangle", "area"),
    "rectangle_perimeter": lambda rng: _quadrilateral(rng, "rectangle", "perimeter"),
    "square_area": lambda rng: _quadrilateral(rng, "square", "area"),
    "square_perimeter": lambda rng: _quadrilateral(rng, "square", "perimeter"),
}
"""Problem kind -> template. Each template draws its diagram from the rng it is given, nothing else."""


def make_problem(seed: int, index: int) -> GeoProblem:
    """Problem `index` of the dataset with this seed; a pure function of (seed, index)."""
    # A string seed is hashed with SHA-512 by `random`, so it is stable across processes.
    rng = random.Random(f"geo3k:{seed}:{index}")
    kind = rng.choice(sorted(TEMPLATES))
    return TEMPLATES[kind](rng)


# ---- writing ---------------------------------------------------------------------------------------


def png_data_uri(png: bytes) -> str:
    """`data:image/png;base64,...` for PNG bytes (the embedded-image form of a row)."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def generate_geo3k(
    out_dir: str | Path, n: int, seed: int = 0, split_name: str = "train", *, embed_images: bool = False
) -> Path:
    """Write `n` problems as `<out_dir>/<split_name>.jsonl` (and `.parquet` when pyarrow is installed).

    Images go to `<out_dir>/images/<id>.png` and rows hold that path relative to `out_dir` (the loader
    resolves it against the data file's folder); `embed_images=True` stores PNG data URIs instead.
    Returns the JSONL path.
    """
    if n < 1:
        raise ValueError(f"generate_geo3k: n must be >= 1, got {n}")
    out_dir = Path(out_dir)
    image_dir = out_dir / "images"
    image_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for index in range(n):
        problem = make_problem(seed, index)
        row_id = f"{split_name}-{index:05d}"
        if embed_images:
            image = png_data_uri(problem.png)
        else:
            (image_dir / f"{row_id}.png").write_bytes(problem.png)
            image = f"images/{row_id}.png"
        rows.append(
            {
                "id": row_id,
                "images": [image],
                "kind": problem.kind,
                "problem": problem.problem,
                "answer": problem.answer,
            }
        )
    jsonl_path = out_dir / f"{split_name}.jsonl"
    jsonl_path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return jsonl_path
    pq.write_table(pa.Table.from_pylist(rows), out_dir / f"{split_name}.parquet")
    return jsonl_path


# ---- loading ---------------------------------------------------------------------------------------


def load_geo3k(path: str | Path) -> list[dict[str, Any]]:
    """Read a geo3k parquet or JSONL file into rows ready for rollout.

    Each row keeps its columns and gains `prompt`: one user message whose content is a list of parts,
    `{"type": "image", "image": ref}` where each `<image>` placeholder was and `{"type": "text", ...}`
    for the text around it. `images` becomes a list of references: a file path (relative paths are
    resolved against the data file's folder), a URL, or a `data:` URI for embedded bytes. `answer`
    becomes a string.
    """
    path = Path(path)
    if path.suffix == ".parquet":
        raw_rows = _read_parquet(path)
    elif path.suffix == ".jsonl":
        raw_rows = _read_jsonl(path)
    else:
        raise ValueError(f"load_geo3k: {path} must be a .parquet or .jsonl file")
    return [_normalise_row(row, index, path) for index, row in enumerate(raw_rows)]


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(f"load_geo3k: reading {path} needs pyarrow (pip install pyarrow)") from exc
    table = pq.read_table(path)
    for column in REQUIRED_COLUMNS:
        if column not in table.column_names:
            raise ValueError(f"load_geo3k: {path} has no column {column!r} (columns: {table.column_names})")
    return table.to_pylist()


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line_number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"load_geo3k: {path} line {line_number} is not valid JSON: {exc}") from exc
    return rows


def _normalise_row(row: dict[str, Any], index: int, path: Path) -> dict[str, Any]:
    where = f"{path} row {index}"
    for column in REQUIRED_COLUMNS:
        if column not in row:
            raise ValueError(f"load_geo3k: {where} has no column {column!r} (columns: {sorted(row)})")
    images = row["images"] if row["images"] is not None else []
    if not isinstance(images, list):
        raise ValueError(f"load_geo3k: {where}: 'images' must be a list, got {type(images).__name__}")
    refs = [_image_ref(image, path.parent, where) for image in images]
    problem = str(row["problem"])
    return {
        **row,
        "id": row.get("id", index),
        "images": refs,
        "problem": problem,
        "prompt": geo3k_prompt(problem, refs, where),
        "answer": str(row["answer"]),
    }


def geo3k_prompt(problem: str, images: list[str], where: str = "geo3k row") -> list[Message]:
    """The user message for a problem: image parts where its `<image>` placeholders were."""
    pieces = problem.split(IMAGE_PLACEHOLDER)
    if len(pieces) - 1 != len(images):
        raise ValueError(
            f"{where}: the problem has {len(pieces) - 1} {IMAGE_PLACEHOLDER!r} placeholders but "
            f"{len(images)} images; each image needs exactly one placeholder"
        )
    parts: list[dict[str, Any]] = []
    for i, text in enumerate(pieces):
        if i > 0:
            parts.append({"type": "image", "image": images[i - 1]})
        if text:
            parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


_IMAGE_MAGIC = {
    b"\x89PNG": "image/png",
    b"\xff\xd8\xff": "image/jpeg",
    b"GIF8": "image/gif",
    b"RIFF": "image/webp",
}
_BASE64_MAGIC = {"iVBOR": "image/png", "/9j/": "image/jpeg", "R0lGOD": "image/gif", "UklGR": "image/webp"}


def _image_ref(image: Any, base_dir: Path, where: str) -> str:
    """One image as a file path, URL or data URI."""
    if isinstance(image, dict):
        if image.get("bytes"):
            return _bytes_data_uri(image["bytes"])
        if image.get("path"):
            return _resolve(image["path"], base_dir)
        raise ValueError(
            f"load_geo3k: {where}: image dict has neither 'bytes' nor 'path': keys {sorted(image)}"
        )
    if isinstance(image, bytes | bytearray):
        return _bytes_data_uri(bytes(image))
    if isinstance(image, str) and image:
        if image.startswith(("data:", "http://", "https://")):
            return image
        for prefix, mime in _BASE64_MAGIC.items():
            if image.startswith(prefix):
                return f"data:{mime};base64,{image}"
        return _resolve(image, base_dir)
    raise ValueError(
        f"load_geo3k: {where}: an image must be a path, URL, data URI, base64 string, bytes, or a "
        f"{{'bytes', 'path'}} dict; got {type(image).__name__}"
    )


def _bytes_data_uri(data: bytes) -> str:
    mime = next(
        (m for magic, m in _IMAGE_MAGIC.items() if data.startswith(magic)), "application/octet-stream"
    )
    return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")


def _resolve(image_path: str, base_dir: Path) -> str:
    candidate = Path(image_path)
    return str(candidate if candidate.is_absolute() else base_dir / candidate)
