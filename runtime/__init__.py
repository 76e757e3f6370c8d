"""sbpc.runtime"""
