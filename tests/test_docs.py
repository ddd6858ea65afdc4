"""The docs: the site builds strictly, the configuration reference matches the schema, the README stays a front page.

The strict build fails on a link to a missing page or anchor and on a page left out of mkdocs.yml's nav (its
`validation` block). A few seconds; no pipeline runs.
"""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README_MAX_LINES = 200


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", REPO / "docs/gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def relative_links(path: Path) -> list[str]:
    """The targets of a Markdown file's links that are neither URLs nor anchors on the same page."""
    targets = re.findall(r"\]\(([^)\s]+)\)", path.read_text())
    return [t for t in targets if not re.match(r"^[a-z]+:", t) and not t.startswith("#")]


def test_site_builds_strictly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, f"mkdocs build --strict failed (make docs):\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "site/index.html").is_file() and (tmp_path / "site/configuration.html").is_file()


def test_configuration_reference_is_current():
    generator = load_generator()
    assert (REPO / "docs/configuration.md").read_text() == generator.render(), (
        f"docs/configuration.md is not what the schema gives: run {generator.REGENERATE}")


def test_configuration_reference_names_every_key():
    import yaml
    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
    text = (REPO / "docs/configuration.md").read_text()
    for block, node in schema["properties"].items():
        assert f"`{block}`" in text
        for key in node.get("properties", {}):
            assert f"`{block}.{key}`" in text, f"{block}.{key} missing from docs/configuration.md"


def test_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move detail into docs/, history into "
        "CHANGELOG.md")


def test_relative_links_resolve():
    for page in (REPO / "README.md", REPO / "config/README.md"):
        for target in relative_links(page):
            path = (page.parent / target.split("#")[0]).resolve()
            assert path.exists(), f"{page.relative_to(REPO)} links to {target}, which does not exist"
