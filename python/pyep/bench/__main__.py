"""`python -m pyep.bench`: see pyep.bench."""
from .launch import main

if __name__ == "__main__":
    main()
