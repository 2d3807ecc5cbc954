"""Wire version 5, frozen: the messages a release of that version wrote, and its reader."""
