"""
Why the server closes an agent's link: the codes of C{pb.Refused}, named
alike by the server that sends one and the agent that logs it.  A refusal
travels as a message just before the close, so that the operator on the
node reads the reason there, not only in the server's log.
"""

from __future__ import annotations

from enum import StrEnum

from llmgw.wire import agent_pb2 as pb


class Refusal(StrEnum):
    """
    The kinds of C{pb.Refused}; the value is its C{code}.

    C{CERTIFICATE_MISMATCH}: the node id claimed is not the CN of the
    agent's certificate.  C{NODE_TAKEN}: another agent holds a live link
    for that node id.  C{NO_NODE_ID}: a Register without one.
    C{REGISTER_FIRST}: the first message was not a Register.
    C{REGISTER_TIMEOUT}: no Register in time.  C{NODE_ID_CHANGED}: a later
    Register claims another node.  C{BAD_FRAME}: a frame of zero or too
    many bytes, or one that is not a message.  C{REPLACED}: the link was
    silent, and another agent for its node took over.
    C{PROTOCOL_VERSION}: the agent speaks a protocol version the server
    does not serve (L{llmgw.wire.versions.mismatch}).
    """

    CERTIFICATE_MISMATCH = "certificate_mismatch"
    NODE_TAKEN = "node_taken"
    NO_NODE_ID = "no_node_id"
    REGISTER_FIRST = "register_first"
    REGISTER_TIMEOUT = "register_timeout"
    NODE_ID_CHANGED = "node_id_changed"
    BAD_FRAME = "bad_frame"
    REPLACED = "replaced"
    PROTOCOL_VERSION = "protocol_version"


def refused(
    code: Refusal, reason: str, certificate_name: str | None, node_id: str | None
) -> pb.ControlMessage:
    """
    @param reason: the server's sentence, as its own log line says it.
    @param certificate_name: the CN of the agent's certificate, L{None}
        without one (a plaintext link).
    @param node_id: the node id the agent claimed, L{None} before any.
    @return: the C{pb.ControlMessage} carrying the refusal.
    """
    return pb.ControlMessage(
        refused=pb.Refused(
            code=code.value,
            reason=reason,
            certificate_name=certificate_name or "",
            node_id=node_id or "",
        )
    )
