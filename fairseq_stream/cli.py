"""Console scripts that run fairseq's own CLIs with this plugin loaded from anywhere.

``fairseq-generate --user-dir fairseq_stream`` only finds the plugin from the
repository root (or from site-packages after a non-editable install), because
fairseq resolves ``--user-dir`` as a path. These wrappers pass the installed
package's directory for the user, so they work from any directory.
"""

import os
import sys


def plugin_dir():
    """The directory to give fairseq as ``--user-dir``."""
    return os.path.dirname(os.path.abspath(__file__))


def _with_user_dir(argv):
    if any(a == "--user-dir" or a.startswith("--user-dir=") for a in argv):
        return argv
    return argv[:1] + ["--user-dir", plugin_dir()] + argv[1:]


def generate():
    """``fairseq-stream-generate``: fairseq-generate with ``--user-dir`` set."""
    sys.argv = _with_user_dir(sys.argv)
    from fairseq_cli.generate import cli_main

    cli_main()


def interactive():
    """``fairseq-stream-interactive``: fairseq-interactive with ``--user-dir`` set."""
    sys.argv = _with_user_dir(sys.argv)
    from fairseq_cli.interactive import cli_main

    cli_main()


def print_plugin_dir(argv=None):
    """``fairseq-stream-user-dir``: print the path for ``--user-dir``."""
    import argparse

    argparse.ArgumentParser(prog="fairseq-stream-user-dir",
                            description="Print the fairseq-stream plugin's folder, for fairseq's --user-dir: "
                            'fairseq-generate ... --user-dir "$(fairseq-stream-user-dir)"').parse_args(argv)
    print(plugin_dir())
