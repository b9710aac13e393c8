"""What each command that writes a folder whole claims there (``FolderClaim``), in one table (``OUTPUT_FOLDERS``):
the command named in the folder's record, the file that describes the others, and what it writes.

The command's own write (``vlfit.atomic_files.staged_folder``) and ``vlfit.flag_index``, which refuses a folder that
is not the command's before the heavy imports, both read it here, so the decision is written once. Nothing here
imports more than ``vlfit.atomic_files``.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlfit.atomic_files import claim_folder

SYNTHETIC_SPLITS = ("train", "validation", "test")  # the splits vlfit make-data writes (vlfit.data.synthetic)
SYNTHETIC_SETTINGS = "vlfit_synthetic_config.json"  # what a synthetic dataset was made with
MERGE_RECORD = "merge.json"  # vlfit merge's record of the runs and weights of a merged model
DEMO_RECORD = "demo.json"  # in a demo's folder: {"flags": ..., "results": ...} (results once the demo is complete)
FILTER_REPORT = "filter_report.json"  # vlfit filter's report: the model, the cut, what each split kept and dropped
MINE_REPORT = "mine_report.json"  # vlfit mine's report: the model, the rule, what each split's rows were given
# The files that describe an export, moved in last: vlfit.inference.exported's manifest, the Immich layout's record.
EXPORT_RECORDS = ("export_manifest.json", "vlfit_export.json")


@dataclass(frozen=True)
class FolderClaim:
    """A command's claim on the folder it writes (see ``vlfit.atomic_files.claim_folder``).

    Attributes:
        command: The command, as a folder's record names it (``vlfit merge``).
        records: The files a write of the command ends with: a folder holding one is the command's (folders
            written before they were recorded).
        names: Everything the command writes there: a folder holding only these is the command's.
    """

    command: str
    records: tuple[str, ...] = ()
    names: frozenset[str] = frozenset()

    def claim(self, folder: str, flag: str = "--output_dir") -> set[str]:
        """``claim_folder``: what an earlier write of the command left in ``folder``, or a refusal in one line."""
        return claim_folder(folder, self.command, flag=flag, records=self.records, names=self.names)


MAKE_DATA = FolderClaim(
    "vlfit make-data",
    (SYNTHETIC_SETTINGS,),
    frozenset({"dataset_dict.json", SYNTHETIC_SETTINGS, *SYNTHETIC_SPLITS,
               *(f"{name}.parquet" for name in SYNTHETIC_SPLITS)}),
)  # fmt: skip
MERGE = FolderClaim("vlfit merge", (MERGE_RECORD,))
EXPORT = FolderClaim("vlfit export", EXPORT_RECORDS)
DEMO = FolderClaim("vlfit demo", (DEMO_RECORD,), frozenset({"data", "model", DEMO_RECORD}))
FILTER = FolderClaim("vlfit filter", (FILTER_REPORT,))
MINE = FolderClaim("vlfit mine", (MINE_REPORT,))
# By command, as the flag index names them: their --output_dir is claimed before the imports.
OUTPUT_FOLDERS = {claim.command: claim for claim in (MAKE_DATA, MERGE, EXPORT, DEMO, FILTER, MINE)}
