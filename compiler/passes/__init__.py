"""sbpc.compiler.passes"""
