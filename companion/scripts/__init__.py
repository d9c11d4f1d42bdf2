"""The standalone scripts, and the sibling modules they import by plain name.

A script imports only torch, the standard library and its siblings here
(``distributed_setup.py``; ``gpt_model.py`` for the GPT scripts), as
nanoGPT's ``train.py`` imports ``model.py``: a reader copies the folder. Run as
a file, a script finds its siblings in its own folder (``sys.path[0]``);
imported as ``companion.scripts.<name>`` (by the checks, the tests and the
chapters), it finds them because importing this package puts its folder on
the path. Import the siblings only by their plain names (``gpt_model``), never
through this package: that would load a second copy of the module.
"""

import sys
from pathlib import Path

if (_HERE := str(Path(__file__).parent)) not in sys.path:
    sys.path.append(_HERE)
