"""sbpc.compiler.ir"""
