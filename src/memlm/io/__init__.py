"""Files on disk, below everything that writes them: atomic writes and checksums (``fileio``), folder locks
(``locking``), the schemas of the metadata files (``schema``)."""
