"""python -m jitllmd"""

from .cli import main

main()
