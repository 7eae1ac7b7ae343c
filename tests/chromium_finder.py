"""chromium_finder.py: where the headless browser of the page tests is (the pp_vis screenshot and the run
report checks import it). Not a browser driver: each check runs Chromium its own way."""
import os
import shutil


def find_chromium():
    """$MOETRON_CHROMIUM, else the first Chromium or Chrome on PATH, else None."""
    env = os.environ.get("MOETRON_CHROMIUM")
    if env:
        return env
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None
