"""common/interrupts.py: a Ctrl-C inside the block is held and raised as it ends (never inside it, where a C++
caller would abort the process), and the default handler is back afterwards."""
import os
import signal

import pytest

from kvlab.common.interrupts import interrupts_held


def test_a_ctrl_c_in_the_block_is_raised_when_it_ends():
    reached_end = False
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(10000))                      # Python runs the signal handler here: it only notes the signal
            reached_end = True
    assert reached_end and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_without_a_ctrl_c_nothing_is_raised():
    with interrupts_held():
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
