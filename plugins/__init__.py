"""Model plugins: the plugin API (plugins.api) and the built-in plugins, one folder each."""
from pathlib import Path

BUILTIN_DIR = Path(__file__).resolve().parent


def builtin_plugin_dir(name: str) -> Path:
    """The folder of a built-in plugin (it holds plugin.toml)."""
    folder = BUILTIN_DIR / name
    if not (folder / "plugin.toml").exists():
        known = sorted(p.parent.name for p in BUILTIN_DIR.glob("*/plugin.toml"))
        raise LookupError(f"no built-in plugin {name!r}; built-ins: {known}")
    return folder


def builtin_plugin_names() -> list[str]:
    return sorted(p.parent.name for p in BUILTIN_DIR.glob("*/plugin.toml"))
