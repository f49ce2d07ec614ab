"""The node side of hpcjobs: what every rank runs once the job starts.

Importing this package stays cheap (no torch) so that the submit side can look task modules up and pickle the
launcher without paying for torch on a login node.
"""
