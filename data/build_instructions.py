"""Build the small GIS instruction dataset (helpers/data/instructions.jsonl) and held-out prompts.

Written for oomkit from templates: short geodata questions with short Python answers (geopandas,
shapely, rasterio, pyproj), the seeds' use case (a LoRA adapter for a GIS assistant). Deterministic:
the same script always writes the same files. Every held-out prompt combines template values that
never appear together in the training set.

Usage: ``python data/build_instructions.py`` (rewrites both files; they are committed).
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN = HERE.parent / "helpers" / "data" / "instructions.jsonl"
HELDOUT = HERE.parent / "helpers" / "data" / "heldout_prompts.jsonl"

FILES = [("roads.shp", "roads"), ("parcels.gpkg", "parcels"), ("rivers.geojson", "rivers"),
         ("buildings.shp", "buildings"), ("wells.csv", "wells"), ("districts.geojson", "districts"),
         ("trees.gpkg", "trees"), ("lakes.shp", "lakes")]  # fmt: skip
CRS = [("EPSG:4326", "WGS 84 longitude/latitude"), ("EPSG:3857", "Web Mercator"),
       ("EPSG:32633", "UTM zone 33N"), ("EPSG:27700", "British National Grid"),
       ("EPSG:2154", "Lambert-93 (France)"), ("EPSG:4490", "CGCS2000 (China)")]  # fmt: skip
DISTANCES = [10, 25, 50, 100, 250, 500]
RASTERS = ["dem.tif", "ndvi.tif", "landcover.tif", "rainfall.tif", "slope.tif"]
COLUMNS = ["area", "name", "population", "length", "height", "type"]


def _tasks():
    """(instruction, response) pairs, one generator per task family."""
    for (path, stem), (code, label) in itertools.product(FILES, CRS):
        yield (
            f"Reproject {path} to {label} ({code}) with geopandas.",
            f'import geopandas as gpd\n\n{stem} = gpd.read_file("{path}")\n{stem} = {stem}.to_crs("{code}")',
        )
    for (path, stem), d in itertools.product(FILES, DISTANCES):
        yield (
            f"Buffer every feature of {path} by {d} metres.",
            f'import geopandas as gpd\n\n{stem} = gpd.read_file("{path}").to_crs(3857)\n'
            f"{stem}['geometry'] = {stem}.buffer({d})",
        )
    for (path, stem), col in itertools.product(FILES, COLUMNS):
        yield (
            f"Print the distinct values of the '{col}' column in {path}.",
            f'import geopandas as gpd\n\n{stem} = gpd.read_file("{path}")\nprint({stem}["{col}"].unique())',
        )
    for (path, stem), col in itertools.product(FILES, COLUMNS):
        yield (
            f"Dissolve {path} by its '{col}' column.",
            f'import geopandas as gpd\n\n{stem} = gpd.read_file("{path}")\nmerged = {stem}.dissolve(by="{col}")',
        )
    for raster, (path, stem) in itertools.product(RASTERS, FILES[:4]):
        yield (
            f"Clip {raster} to the outline of {path}.",
            f"import geopandas as gpd\nimport rasterio\nfrom rasterio.mask import mask\n\n"
            f'{stem} = gpd.read_file("{path}")\nwith rasterio.open("{raster}") as src:\n'
            f"    clipped, transform = mask(src, {stem}.to_crs(src.crs).geometry, crop=True)",
        )
    for a, b in itertools.permutations(FILES[:6], 2):
        yield (
            f"Keep the features of {a[0]} that intersect {b[0]}.",
            f'import geopandas as gpd\n\n{a[1]} = gpd.read_file("{a[0]}")\n{b[1]} = gpd.read_file("{b[0]}")\n'
            f'hits = gpd.sjoin({a[1]}, {b[1]}.to_crs({a[1]}.crs), predicate="intersects")',
        )
    for raster in RASTERS:
        yield (
            f"Read {raster} and print its minimum and maximum value.",
            f'import rasterio\n\nwith rasterio.open("{raster}") as src:\n    band = src.read(1, masked=True)\n'
            "print(band.min(), band.max())",
        )
        yield (
            f"Print the CRS, size and resolution of {raster}.",
            f'import rasterio\n\nwith rasterio.open("{raster}") as src:\n    print(src.crs, src.width, src.height, src.res)',
        )
        for code, _ in CRS[:3]:
            yield (
                f"What CRS code does a raster need to match {code} data, and how do I check {raster}?",
                f'import rasterio\n\nwith rasterio.open("{raster}") as src:\n    print(src.crs.to_string() == "{code}")',
            )
    for path, stem in FILES:
        yield (
            f"Compute the area in square metres of each polygon in {path}.",
            f'import geopandas as gpd\n\n{stem} = gpd.read_file("{path}").to_crs(6933)  # equal-area\n'
            f'{stem}["area_m2"] = {stem}.area',
        )
        yield (
            f"Save {path} as GeoJSON.",
            f'import geopandas as gpd\n\ngpd.read_file("{path}").to_file("{stem}.geojson", driver="GeoJSON")',
        )
        yield (f"Count the features in {path}.", f'import geopandas as gpd\n\nprint(len(gpd.read_file("{path}")))')
    for (code_a, _), (code_b, _) in itertools.permutations(CRS[:4], 2):
        yield (
            f"Transform the point (12.5, 41.9) from {code_a} to {code_b} with pyproj.",
            f'from pyproj import Transformer\n\nt = Transformer.from_crs("{code_a}", "{code_b}", always_xy=True)\n'
            "print(t.transform(12.5, 41.9))",
        )


HELD_OUT = [
    "Reproject harbours.shp to UTM zone 33N (EPSG:32633) with geopandas.",
    "Buffer every feature of schools.gpkg by 75 metres.",
    "Print the distinct values of the 'owner' column in parcels.gpkg.",
    "Read elevation.tif and print its minimum and maximum value.",
    "Count the features in bridges.geojson.",
    "Transform the point (2.35, 48.85) from EPSG:4326 to EPSG:2154 with pyproj.",
]


def build() -> tuple[int, int]:
    rows = [{"instruction": q, "response": a} for q, a in _tasks()]
    random.Random(7).shuffle(rows)  # mixed task families in every batch, same order on every build
    TRAIN.write_text("".join(json.dumps(r) + "\n" for r in rows))
    HELDOUT.write_text("".join(json.dumps({"instruction": q}) + "\n" for q in HELD_OUT))
    return len(rows), len(HELD_OUT)


if __name__ == "__main__":
    n, h = build()
    print(f"{TRAIN.name}: {n} examples; {HELDOUT.name}: {h} held-out prompts")
