"""How a command-line failure must look: exit status 2 and exactly one line on stderr,
`moremoe <command>: error: <what>`, never a traceback."""
import re

from moremoe.cli import main


def fails(capsys, argv, match, *, code=2):
    """Run `moremoe argv`; assert it fails with one stderr line matching `match`; return it."""
    capsys.readouterr()
    try:
        rc = main(list(argv))
    except SystemExit as exit_:            # argparse's own errors
        rc = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == code, (rc, err)
    assert len(err) == 1, err
    assert re.match(r"moremoe [a-z -]+: error: ", err[0]), err[0]
    assert re.search(match, err[0]), err[0]
    return err[0]
