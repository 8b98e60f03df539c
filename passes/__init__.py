"""One module per pass. Each imports its heavy libraries inside run(), so listing passes stays cheap."""
