"""A stand-in for sudo(8), installed as `sudo` on the PATH of the test SSH server's commands.

Real sudo needs root, a login user and a sudoers file, which a unit test must not set up on the machine
it runs on (the lab hosts have the real one: tests/lab). This follows sudo's documented behaviour for
what ddtree-ops uses: `-n` fails with "a password is required" when the rule wants one; `-S` writes the
`-p` prompt on stderr and reads the password from stdin up to a newline, byte by byte (so the rest of
stdin stays for the command), says "Sorry, try again." and asks again after a wrong one, gives up after
three; `--` ends the options; then the command replaces it (exec), stdin and all.

STANDIN_SUDO_RULE: nopasswd | password | denied; STANDIN_SUDO_PASSWORD; STANDIN_SUDO_LOG: a file that
gets one line per password read (never the password).
"""

import os
import sys


def read_line() -> str | None:
    """A line from stdin, or None at its end."""
    data = b""
    while (byte := os.read(0, 1)) != b"\n":
        if byte == b"":
            return None
        data += byte
    return data.decode()


def main() -> None:
    args = sys.argv[1:]
    non_interactive = from_stdin = False
    prompt = "[sudo] password: "
    while args and args[0].startswith("-"):
        flag = args.pop(0)
        if flag == "--":
            break
        if flag == "-n":
            non_interactive = True
        elif flag == "-S":
            from_stdin = True
        elif flag == "-p":
            prompt = args.pop(0)
        else:
            sys.exit(f"sudo: unknown option {flag}")
    rule = os.environ.get("STANDIN_SUDO_RULE", "nopasswd")
    if rule == "denied":
        sys.stderr.write(f"Sorry, user {os.environ.get('USER', 'deploy')} is not allowed to execute "
                         f"'{' '.join(args)[:40]}' as root on testhost.\n")
        sys.exit(1)
    if rule == "password":
        if non_interactive:
            sys.stderr.write("sudo: a password is required\n")
            sys.exit(1)
        if not from_stdin:
            sys.stderr.write("sudo: a terminal is required to read the password; either use the -S option to read "
                             "from standard input or configure an askpass helper\n")
            sys.exit(1)
        for _ in range(3):
            sys.stderr.write(prompt)
            sys.stderr.flush()
            given = read_line()
            if given is None:
                sys.stderr.write("sudo: no password was provided\n")
                sys.exit(1)
            with open(os.environ["STANDIN_SUDO_LOG"], "a") as log:
                log.write("password read\n")
            if given == os.environ["STANDIN_SUDO_PASSWORD"]:
                break
            sys.stderr.write("Sorry, try again.\n")
        else:
            sys.stderr.write("sudo: 3 incorrect password attempts\n")
            sys.exit(1)
    os.execvp(args[0], args)


main()
