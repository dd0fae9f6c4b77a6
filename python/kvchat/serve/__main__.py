"""python -m kvchat.serve MODEL [options]"""

from .cli import main

main()
