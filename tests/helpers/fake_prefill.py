"""A forged prefill engine for tests/test_security_handoff.py and the wire fuzzer: binds a handoff address and answers
every pull as told. Stdlib only (it may run as another user).
argv: address, mode, answer file, memfd bytes, sealed (1/0), pace_s.
Modes: answer (the file's bytes as the message body, with a memfd of that size if > 0), silent (reads the pull,
never answers), trickle (one byte of the answer every `pace_s` seconds)."""
import fcntl
import os
import socket
import sys
import threading
import time

address, mode, answer_file, memfd_bytes, sealed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
pace_s = float(sys.argv[6])
body = open(answer_file, "rb").read()


def memfd():
    fd = os.memfd_create("kvlab-handoff", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, memfd_bytes)
    if sealed == "1":
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def handle(conn):
    with conn:
        conn.settimeout(30)
        try:
            conn.recv(1 << 16)
            if mode == "silent":
                time.sleep(30)
            elif mode == "trickle":
                for byte in len(body).to_bytes(8, "little") + body:
                    conn.sendall(bytes([byte]))
                    time.sleep(pace_s)
            else:
                fds = [memfd()] if memfd_bytes > 0 else []
                head = len(body).to_bytes(8, "little")
                if fds:
                    socket.send_fds(conn, [head], fds)
                    os.close(fds[0])
                else:
                    conn.sendall(head)
                conn.sendall(body)
                conn.recv(1 << 16)                   # the ack
        except OSError:
            pass


server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind("\0" + address)
server.listen(16)
print("ready", flush=True)
while True:
    conn, _ = server.accept()
    threading.Thread(target=handle, args=(conn,), daemon=True).start()
