"""Print a pip constraints file pinning every requirement to its lower bound (`name>=X` -> `name==X`).

CI installs requirements.txt with it to check that the oldest versions the file allows still
work; a requirement without a lower bound is an error (it could not be checked).
"""

import re
import sys

for raw in open(sys.argv[1]):
    line = raw.split("#")[0].strip()
    if not line:
        continue
    m = re.match(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*.*?>=\s*([0-9][0-9A-Za-z.]*)", line)
    if m is None:
        sys.exit(f"error: no lower bound in requirement {line!r}")
    print(f"{m.group(1)}=={m.group(3)}")
